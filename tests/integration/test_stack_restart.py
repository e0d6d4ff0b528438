"""``iserve up`` on a state directory whose Redis kept deployments from before a stop:
it returns only once their workers serve again, so the first request after it is
answered (it got 503s for about a second before), and it names any it could not restore."""

from __future__ import annotations

import json
import shutil

import pytest

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from tests.conftest import running_stack
from tests.integration.helpers import deploy, make_checkpoint, register, rid, with_store

pytestmark = pytest.mark.integration


def _generate(stack, **target) -> infer_pb.GenerateFinal:
    replies = stack.inference.Generate(
        infer_pb.GenerateRequest(
            request_id=rid(),
            prompt="once",
            max_tokens=2,
            sampling=common.SamplingParams(ignore_eos=True),
            **target,
        ),
        timeout=60,
    )
    return [r for r in replies if r.HasField("final")][-1].final


def test_up_returns_once_the_deployments_kept_from_before_are_served(tmp_path):
    state = tmp_path / "state"
    with running_stack(state) as first:
        register(first, "kept", make_checkpoint(first, "kept"))
        register(first, "lost", make_checkpoint(first, "lost"))
        kept = [deploy(first, "kept").deployment.deployment_id for _ in range(2)]
        lost = deploy(first, "lost").deployment.deployment_id
    # Its weights are gone while the stack is down: it cannot be restored.
    shutil.rmtree(state / "models" / "lost")

    said: list[str] = []
    with running_stack(state, log=said.append) as second:
        # At once, with no retry: every kept deployment answers, by id and by model.
        for deployment_id in kept:
            assert _generate(second, deployment_id=deployment_id).usage.completion_tokens == 2
        assert _generate(second, model_id="kept").usage.completion_tokens == 2
        # A stop of the whole stack is no failure: the restores spent no restart budget.
        for deployment_id in kept:
            record = json.loads(with_store(second, lambda st, d=deployment_id: st.get_restarts(d)))
            assert (record["in_a_row"], record["total"]) == (0, 0), record
            reason = second.deployments.GetDeployment(
                deploy_pb.GetDeploymentRequest(deployment_id=deployment_id)
            ).deployment.state_reason
            assert reason == "serves again after a stop of the stack"

    assert f"restoring 3 deployment(s) kept in Redis: {', '.join(sorted([*kept, lost]))}" in said
    for deployment_id in kept:
        assert any(line.startswith(f"deployment {deployment_id} restored (") for line in said)
    # Its agent refused it for its checkpoint: failed at the first restart, not retried
    # until the budget was spent.
    assert any(
        line.startswith(f"deployment {lost} was not restored (FAILED: not restarted:")
        for line in said
    ), said
