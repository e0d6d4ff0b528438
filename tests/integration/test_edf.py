"""EDF on the live stack: the deployment records its objectives; an impossible deadline
is refused at once with DEADLINE_EXCEEDED and nothing is queued; feasible requests are
served in deadline order, not arrival order."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from tests.integration.conftest import SERVED_SHAPE
from tests.integration.helpers import cli, deploy, generate, make_checkpoint, register, rid

pytestmark = pytest.mark.integration

EDF = common.SCHEDULING_POLICY_EDF
GREEDY_NO_EOS = common.SamplingParams(ignore_eos=True)


@pytest.fixture(scope="module")
def edf(stack) -> deploy_pb.Deployment:
    register(stack, "edf-llama", make_checkpoint(stack, "edf-llama", **SERVED_SHAPE))
    dep = deploy(
        stack,
        "edf-llama",
        batch_size=1,
        max_output_tokens=600,
        objectives=common.ServiceObjectives(scheduling=EDF, ttft_slo_ms=120_000),
    ).deployment
    yield dep
    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
    )


def test_the_deployment_records_its_objectives(stack, edf):
    got = stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id=edf.deployment_id)
    ).deployment
    assert got.objectives.scheduling == EDF and got.objectives.ttft_slo_ms == 120_000
    listed = cli(stack, "deployments", "--model", "edf-llama")
    assert listed.returncode == 0, listed.stderr
    assert "edf ttft<=120000ms" in listed.stdout


def test_an_impossible_deadline_is_refused_at_once(stack, edf):
    # One request teaches the deployment's predictor what a token costs here.
    generate(
        stack, deployment_id=edf.deployment_id, prompt="warm up", max_tokens=20,
        sampling=GREEDY_NO_EOS,
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        generate(
            stack,
            deployment_id=edf.deployment_id,
            prompt="too late",
            max_tokens=500,
            deadline_ms=5,
            sampling=GREEDY_NO_EOS,
        )
    elapsed = time.monotonic() - started
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = refused.value.details()
    assert "predicted" in details and "allowed" in details and "deadline_ms 5 ms" in details
    assert elapsed < 1.0  # refused, not served and then found late
    # Nothing of it was queued or run: the next request starts at once.
    _, final = generate(
        stack, deployment_id=edf.deployment_id, prompt="next", max_tokens=2,
        sampling=GREEDY_NO_EOS,
    )  # fmt: skip
    assert final.timings.queue_ms < 50


def test_feasible_requests_are_served_in_deadline_order(stack, edf):
    finished: list[str] = []
    lock = threading.Lock()
    blocker_streaming = threading.Event()

    def run(name: str, max_tokens: int, deadline_ms: int = 0) -> None:
        request = infer_pb.GenerateRequest(
            request_id=rid(),
            deployment_id=edf.deployment_id,
            prompt=name,
            max_tokens=max_tokens,
            deadline_ms=deadline_ms,
            sampling=GREEDY_NO_EOS,
        )
        for message in stack.inference.Generate(request, timeout=120):
            if message.HasField("delta"):
                blocker_streaming.set()
        with lock:
            finished.append(name)

    blocker = threading.Thread(target=run, args=("blocker", 590))
    blocker.start()
    assert blocker_streaming.wait(30)  # the blocker holds the only slot
    # Arrival order late, soon (the test stack's queues hold 2); deadlines far apart and
    # both reachable.
    waiting = []
    for name, deadline_ms in (("late", 110_000), ("soon", 90_000)):
        thread = threading.Thread(target=run, args=(name, 5, deadline_ms))
        thread.start()
        waiting.append(thread)
        time.sleep(0.05)
    for thread in [blocker, *waiting]:
        thread.join(timeout=150)
    assert finished == ["blocker", "soon", "late"]
