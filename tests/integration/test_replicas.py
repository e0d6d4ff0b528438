"""Replicas on the live stack: two replicas of a tiny model (one per virtual device) both
serve, one survives the other's worker being killed, remove stops both; counts that are
invalid or do not fit leave nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from tests.conftest import QUEUE_CAPACITY
from tests.integration.helpers import (
    cli,
    deploy,
    generate,
    make_checkpoint,
    register,
    reserved_by_device,
    rid,
    wait_for,
)

READY = deploy_pb.DEPLOYMENT_STATE_READY
STARTING = deploy_pb.DEPLOYMENT_STATE_STARTING
LIVE = (agent_pb.WORKER_STATE_STARTING, agent_pb.WORKER_STATE_READY)
NO_EOS = common.SamplingParams(ignore_eos=True)
MODEL = "twin-llama"
# Tokens of a generation that holds its replica's slot for a while (about 2 s here, idle).
HOLD = 1500


@pytest.fixture(scope="module")
def twin(stack) -> str:
    register(stack, MODEL, make_checkpoint(stack, MODEL))
    yield MODEL
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id=MODEL))


def _tokens_generated(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = worker_service_pb2_grpc.WorkerServiceStub(ch)
        return stub.GetWorkerStats(worker_pb.GetWorkerStatsRequest(), timeout=10).tokens_generated


def _active_requests(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = worker_service_pb2_grpc.WorkerServiceStub(ch)
        return stub.GetWorkerStats(worker_pb.GetWorkerStatsRequest(), timeout=10).active_requests


def _live_workers(stack, group_id: str) -> list[agent_pb.WorkerInfo]:
    reply = stack.agent.ListWorkers(agent_pb.ListWorkersRequest(deployment_id=group_id))
    return [w for w in reply.workers if w.state in LIVE]


def _get(stack, deployment_id: str) -> deploy_pb.Deployment:
    return stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id=deployment_id)
    ).deployment


def _model_deployments(stack) -> list[deploy_pb.Deployment]:
    reply = stack.deployments.ListDeployments(deploy_pb.ListDeploymentsRequest(model_id=MODEL))
    return list(reply.deployments)


def _remove_two_replicas(stack, deployment_id: str) -> None:
    """Remove the deployment; both replicas' workers stop."""
    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=deployment_id)
    )
    assert wait_for(
        lambda: (
            not _live_workers(stack, deployment_id)
            and not _live_workers(stack, f"{deployment_id}.r1")
        ),
        timeout=30,
    )


def _generate_many(stack, deployment_id: str, count: int) -> list[int]:
    """``count`` concurrent generations; the tokens each streamed."""

    def one(i: int) -> int:
        deltas, final = generate(
            stack,
            deployment_id=deployment_id,
            prompt=f"hello {i}",
            max_tokens=24,
            sampling=NO_EOS,
        )
        assert final.finish_reason
        return sum(len(d.token_ids) for d in deltas)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_two_replicas_serve_and_one_heals_while_the_other_serves(stack, twin):
    before = reserved_by_device(stack)
    dep = deploy(stack, twin, replicas=2, batch_size=1, max_output_tokens=HOLD).deployment
    deployment_id = dep.deployment_id
    assert [(r.index, r.state) for r in dep.replicas] == [(0, READY), (1, READY)]
    places = [
        {(d.node_id, d.device_id) for s in r.placement.stages for d in s.devices}
        for r in dep.replicas
    ]
    assert not places[0] & places[1]  # each replica on devices of its own
    addresses = [r.worker_address for r in dep.replicas]
    assert len(set(addresses)) == 2

    # Concurrent requests spread over both replicas: while one stream holds a replica's
    # only slot (it is generating: its first token came), the router sends the next
    # request to the idle replica. Long generations, so both are still running together.
    tokens = [_tokens_generated(a) for a in addresses]
    holders = []
    try:
        for i in range(2):
            stream = stack.inference.Generate(
                infer_pb.GenerateRequest(
                    request_id=rid(),
                    deployment_id=deployment_id,
                    prompt=f"hold {i}",
                    max_tokens=HOLD,
                    sampling=NO_EOS,
                ),
                timeout=120,
            )
            holders.append(stream)
            assert next(stream).HasField("delta")
        active = [_active_requests(a) for a in addresses]
        assert active == [1, 1], active
    finally:
        for stream in holders:
            stream.cancel()
    grown = [_tokens_generated(a) - t for a, t in zip(addresses, tokens, strict=True)]
    assert all(g > 0 for g in grown), grown
    assert wait_for(lambda: [_active_requests(a) for a in addresses] == [0, 0], timeout=30)
    assert _generate_many(stack, deployment_id, 4) == [24] * 4
    # The scheduler's log names the replica that served each request.
    served = (stack.settings.state_dir / "logs" / "scheduler.log").read_text()
    assert f"served by deployment {deployment_id}: " in served
    assert f"served by deployment {deployment_id} (replica 1): " in served

    # Kill replica 0's worker: the replica is taken out to be restarted while the record
    # points at replica 1; the deployment stays READY. Then replica 0 serves again.
    held = reserved_by_device(stack)
    [victim] = _live_workers(stack, deployment_id)
    os.kill(victim.pid, signal.SIGKILL)
    assert wait_for(lambda: _get(stack, deployment_id).replicas[0].state != READY, timeout=20)
    now = _get(stack, deployment_id)
    assert now.state == READY
    assert now.replicas[1].state == READY
    assert now.replicas[0].state == STARTING
    reason = now.replicas[0].state_reason
    # The agent's death event, or the deployer's periodic check of what the agents run,
    # whichever saw it first.
    assert reason.startswith(
        (
            "restart 1 in 1 s after: worker",
            "restart 1 in 1 s after: its agent reports, rank(s) [0] are not running",
        )
    ), reason
    assert now.worker_address == addresses[1]

    def replica0_back() -> bool:
        again = _get(stack, deployment_id).replicas[0]
        return again.state == READY and again.worker_address not in ("", addresses[0])

    assert wait_for(replica0_back, timeout=120)
    now = _get(stack, deployment_id)
    assert re.match(
        r"restarted \d+ time\(s\) \(\d+ in a row against the restart budget\); last error: ",
        now.replicas[0].state_reason,
    )
    assert now.worker_address == now.replicas[0].worker_address
    addresses = [now.replicas[0].worker_address, addresses[1]]
    assert wait_for(lambda: reserved_by_device(stack) == held, timeout=20)

    listed = cli(stack, "deployments", "--model", MODEL)
    assert listed.returncode == 0, listed.stderr
    assert f"replica 0 READY {addresses[0]}" in listed.stdout
    assert f"replica 1 READY {addresses[1]}" in listed.stdout
    listed = cli(stack, "deployments", "--model", MODEL, "--json")
    [record] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["state"], r["worker_address"]) for r in record["replicas"]] == [
        ("DEPLOYMENT_STATE_READY", addresses[0]),
        ("DEPLOYMENT_STATE_READY", addresses[1]),
    ]

    # Generations keep succeeding through the scheduler, on both replicas again, once
    # its routing cache has the new record (it refreshes every second).
    time.sleep(1.5)
    tokens = [_tokens_generated(a) for a in addresses]
    assert _generate_many(stack, deployment_id, 4) == [24] * 4
    assert generate(stack, model_id=MODEL, prompt="by model", max_tokens=4)[1].finish_reason
    assert sum(_tokens_generated(a) for a in addresses) > sum(tokens)

    # Remove stops every replica and releases every reservation.
    _remove_two_replicas(stack, deployment_id)
    assert reserved_by_device(stack) == before
    assert _model_deployments(stack) == []


def _refused(stack, twin, replicas: int) -> tuple[grpc.StatusCode, str]:
    before = reserved_by_device(stack)
    workers = stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    with pytest.raises(grpc.RpcError) as failure:
        deploy(stack, twin, replicas=replicas)
    assert _model_deployments(stack) == []
    assert reserved_by_device(stack) == before
    after = stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    assert {(w.deployment_id, w.pid) for w in after if w.state in LIVE} <= {
        (w.deployment_id, w.pid) for w in workers if w.state in LIVE
    }
    return failure.value.code(), failure.value.details()


def test_more_than_sixteen_replicas_is_invalid_and_creates_nothing(stack, twin):
    code, details = _refused(stack, twin, 17)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "replicas must be at most 16, got 17"


def test_replicas_that_do_not_all_fit_are_resource_exhausted_and_leave_nothing(stack, twin):
    code, details = _refused(stack, twin, 3)  # two devices, one replica each at most
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith(f"replica 3 of 3 of {MODEL} "), details
    planned = cli(stack, "deploy", MODEL, "--tp", "1", "--pp", "1", "--replicas", "3", "--plan")
    assert planned.returncode == 1
    assert "RESOURCE_EXHAUSTED" in planned.stderr and "replica 3 of 3" in planned.stderr
    planned = cli(stack, "deploy", MODEL, "--tp", "1", "--pp", "1", "--replicas", "2", "--plan")
    assert planned.returncode == 0, planned.stderr
    assert "2 replicas" in planned.stderr
    assert "replica 0 stage 0" in planned.stderr and "replica 1 stage 0" in planned.stderr
    assert _model_deployments(stack) == []


def test_a_replica_back_from_a_restart_takes_the_requests_waiting_on_the_other(stack, twin):
    """Requests sent while replica 0 restarts all go to replica 1. Once replica 0 is
    back it takes the next of them at once, and they stream from it: it idled before
    until a new request arrived, and the requests it then took failed with UNAVAILABLE
    "replica 0 ... stopped serving" (each carried the record of before its restart)."""
    dep = deploy(stack, twin, replicas=2, batch_size=1, max_output_tokens=HOLD).deployment
    deployment_id = dep.deployment_id
    old = [r.worker_address for r in dep.replicas]
    try:
        [victim] = _live_workers(stack, deployment_id)  # replica 0's
        os.kill(victim.pid, signal.SIGKILL)
        assert wait_for(lambda: _get(stack, deployment_id).replicas[0].state != READY, 20)
        time.sleep(1.5)  # the scheduler's routing cache sees replica 0 out

        def one(i: int) -> grpc.StatusCode:
            try:
                generate(
                    stack,
                    timeout=180,
                    deployment_id=deployment_id,
                    prompt=f"wait {i}",
                    max_tokens=HOLD,
                    sampling=NO_EOS,
                )
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        # One runs on replica 1, the rest wait there (the stack's queue capacity).
        count = 1 + QUEUE_CAPACITY
        with ThreadPoolExecutor(count) as pool:
            outcomes = list(pool.map(one, range(count)))
        assert outcomes == [grpc.StatusCode.OK] * count, outcomes
        again = _get(stack, deployment_id).replicas[0]
        assert again.state == READY and again.worker_address not in ("", old[0])
        served = (stack.settings.state_dir / "logs" / "scheduler.log").read_text()
        by_replica = [
            len(re.findall(rf"request \S+ served by deployment {deployment_id}{suffix}: ", served))
            for suffix in ("", r" \(replica 1\)")
        ]
        # All arrived while replica 0 was out; it took the last once back.
        assert sum(by_replica) == count and by_replica[0] >= 1, by_replica
    finally:
        _remove_two_replicas(stack, deployment_id)
