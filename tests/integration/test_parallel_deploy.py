"""Tensor- and pipeline-parallel deployments through the real stack: two ranks on the two
virtual CPU devices, deployed with ``iserve deploy --tp 2`` / ``--pp 2``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import grpc
import psutil
import pytest

from monitor_agent.engine.engine import Engine, SamplingConfig
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from tests.integration.helpers import (
    deploy,
    generate,
    make_checkpoint,
    register,
    reserved_by_device,
    wait_for,
)
from tests.integration.test_bad_inputs import _Stream

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _devices(dep: deploy_pb.Deployment) -> list[str]:
    return [f"{ref.node_id}/{ref.device_id}" for s in dep.placement.stages for ref in s.devices]


def _workers(stack, deployment_id: str) -> list[agent_pb.WorkerInfo]:
    request = agent_pb.ListWorkersRequest(deployment_id=deployment_id)
    return sorted(stack.agent.ListWorkers(request).workers, key=lambda w: w.rank)


def _cli_deploy(stack, model_id: str, *flags: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "deploy", model_id, *flags],
        env={**os.environ, **stack.env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[-1]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_parallel_deployment_streams_the_single_rank_tokens(stack, tp, pp):
    model_id = f"par-tp{tp}-pp{pp}"
    path = make_checkpoint(stack, model_id, num_layers=4, num_heads=4, num_kv_heads=2)
    register(stack, model_id, path)
    engine = Engine(stack.models_root / path, max_seq_len=128)
    prompt_ids = engine.encode(PROMPT)
    expected = [
        s.token_id for s in engine.generate(prompt_ids, 12, SamplingConfig(ignore_eos=True))
    ]
    before = reserved_by_device(stack)

    deployment_id = _cli_deploy(
        stack, model_id, "--tp", str(tp), "--pp", str(pp), "--max-output", "64"
    )
    dep = stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id=deployment_id)
    ).deployment
    assert dep.state == deploy_pb.DEPLOYMENT_STATE_READY
    assert (dep.config.tensor_parallel, dep.config.pipeline_parallel) == (tp, pp)
    assert [(s.first_layer, s.layer_count) for s in dep.placement.stages] == (
        [(0, 4)] if pp == 1 else [(0, 2), (2, 2)]
    )
    devices = _devices(dep)
    assert len(set(devices)) == 2
    reserved = reserved_by_device(stack)
    for stage in dep.placement.stages:
        for ref, need in zip(stage.devices, stage.reserved_bytes, strict=True):
            device = f"{ref.node_id}/{ref.device_id}"
            assert need > 0 and reserved[device] == before[device] + need
    state = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    holding = [
        f"{d.ref.node_id}/{d.ref.device_id}"
        for n in state.nodes
        for d in n.devices
        if deployment_id in d.deployment_ids
    ]
    assert sorted(holding) == sorted(devices)
    workers = _workers(stack, deployment_id)
    assert [(w.rank, w.state) for w in workers] == [
        (0, agent_pb.WORKER_STATE_READY),
        (1, agent_pb.WORKER_STATE_READY),
    ]
    assert workers[0].address == dep.worker_address and workers[1].address == ""

    deltas, final = generate(
        stack,
        deployment_id=deployment_id,
        prompt=PROMPT,
        max_tokens=12,
        sampling=common.SamplingParams(ignore_eos=True),
    )
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == engine.tokenizer.decode(expected)
    assert final.finish_reason == common.FINISH_REASON_LENGTH

    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=deployment_id)
    )
    assert reserved_by_device(stack) == before
    assert wait_for(lambda: not any(_alive(w.pid) for w in workers), timeout=10)
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id=model_id))


def test_a_rank_killed_mid_stream_restarts_the_whole_group(stack):
    # Big enough that a long generation lasts seconds on 2 cores.
    path = make_checkpoint(
        stack, "par-doomed", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4
    )
    register(stack, "par-doomed", path)
    dep = deploy(
        stack,
        "par-doomed",
        config=common.DeploymentConfig(tensor_parallel=2),
        max_output_tokens=1500,
    ).deployment
    held = reserved_by_device(stack)
    workers = _workers(stack, dep.deployment_id)
    assert len(workers) == 2
    stream = _Stream(
        stack,
        deployment_id=dep.deployment_id,
        prompt="hello",
        max_tokens=1500,
        sampling=common.SamplingParams(ignore_eos=True),
    )
    assert stream.first.wait(60) and stream.error is None
    os.kill(workers[1].pid, signal.SIGKILL)  # a follower: rank 0 must notice and end
    stream.thread.join(30)
    assert stream.error is not None
    assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error.details()

    # Both ranks go (the group cannot serve without one), then both start again:
    # served again without a Deploy call, its memory reserved once.
    def restarted() -> bool:
        d = stack.deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id=dep.deployment_id)
        ).deployment
        pids = {w.pid for w in _workers(stack, dep.deployment_id)}
        return (
            d.state == deploy_pb.DEPLOYMENT_STATE_READY
            and len(pids) == 2
            and not (pids & {w.pid for w in workers})
        )

    assert wait_for(restarted, timeout=120)
    assert wait_for(lambda: not _alive(workers[0].pid), timeout=10)
    d = stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id=dep.deployment_id)
    ).deployment
    assert re.match(
        r"restarted \d+ time\(s\) \(\d+ in a row against the restart budget\); last error: ",
        d.state_reason,
    )
    assert any(word in d.state_reason for word in ("rank", "unreachable", "reserve"))
    _, final = generate(stack, deployment_id=dep.deployment_id, prompt="again", max_tokens=4)
    assert final.usage.completion_tokens >= 1
    assert wait_for(lambda: reserved_by_device(stack) == held, timeout=20)
    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
    )
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="par-doomed"))
