"""Faults on real processes, on a stack of this module's own (it kills its services,
its agent and its Redis): a worker killed mid-stream, the deployer and the scheduler
SIGKILLed, the agent SIGKILLed until its heartbeat lapses, Redis down and back, and the
whole stack stopped and started. Each time the deployment serves again without a Deploy
call, its memory reserved once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import grpc
import pytest

from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.cli import stack as launcher
from services.redis_embedded import start_redis
from services.settings import load_settings, read_stack_file
from tests.conftest import Stack, running_stack
from tests.integration.conftest import SERVED_SHAPE
from tests.integration.helpers import (
    cli,
    deploy,
    generate,
    make_checkpoint,
    register,
    reserved_by_device,
    rid,
    wait_for,
    with_store,
)

pytestmark = pytest.mark.integration

READY = deploy_pb.DEPLOYMENT_STATE_READY
MODEL = "faulty-llama"
LONG = 1500
HEAL_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory) -> Iterator[Stack]:
    # A budget no test here spends: an agent restarted slowly on a loaded machine must not
    # outlast the default five tries (31 s of backoff) and fail the deployment.
    with running_stack(
        tmp_path_factory.mktemp("iserve-faults"), ISERVE_MAX_RESTARTS="50"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def model(own_stack) -> str:
    register(own_stack, MODEL, make_checkpoint(own_stack, MODEL, **SERVED_SHAPE))
    return MODEL


@pytest.fixture
def deployment(own_stack, model) -> Iterator[deploy_pb.Deployment]:
    """A READY deployment of the test's own (its restart budget fresh), removed after."""
    dep = deploy(own_stack, model, max_output_tokens=LONG).deployment
    yield dep
    try:
        own_stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id), timeout=60
        )
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise


class Stream:
    """A long generation consumed on a thread; ``first`` is set at the first delta."""

    def __init__(self, stack: Stack, deployment_id: str):
        self.call = stack.inference.Generate(
            infer_pb.GenerateRequest(
                request_id=rid(),
                deployment_id=deployment_id,
                prompt="Once upon a time",
                max_tokens=LONG,
                sampling=common.SamplingParams(ignore_eos=True),
            ),
            timeout=300,
        )
        self.first = threading.Event()
        self.error: grpc.RpcError | None = None
        self.final: infer_pb.GenerateFinal | None = None
        self.tokens = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for message in self.call:
                if message.HasField("delta"):
                    self.tokens += len(message.delta.token_ids)
                    self.first.set()
                else:
                    self.final = message.final
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first.set()


def current(stack: Stack, deployment_id: str) -> deploy_pb.Deployment | None:
    try:
        return stack.deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id=deployment_id), timeout=10
        ).deployment
    except grpc.RpcError:
        return None  # the deployer (or Redis) is not back yet


def worker_pids(stack: Stack, deployment_id: str) -> list[int]:
    try:
        reply = stack.agent.ListWorkers(
            agent_pb.ListWorkersRequest(deployment_id=deployment_id), timeout=10
        )
    except grpc.RpcError:
        return []
    return [w.pid for w in reply.workers if w.state == agent_pb.WORKER_STATE_READY]


def serving_again(stack: Stack, deployment_id: str, old_pids: list[int]) -> deploy_pb.Deployment:
    """The deployment once it is READY on new workers (asserts it gets there)."""

    def healed() -> bool:
        now = current(stack, deployment_id)
        pids = worker_pids(stack, deployment_id)
        return now is not None and now.state == READY and bool(pids) and pids != old_pids

    assert wait_for(healed, timeout=HEAL_TIMEOUT_S, interval=0.5), current(stack, deployment_id)
    return current(stack, deployment_id)


def restart_reasons(stack: Stack, deployment_id: str) -> list[str]:
    """Why each restart of the deployment's replicas was needed, oldest first (from the
    events the deployer published when it took a replica out to restart it)."""

    async def events(store):
        found, last = [], "0-0"
        while batch := await store.read_events(last, block_ms=10):
            found += batch
            last = batch[-1][0]
        return found

    found = []
    for _id, event in with_store(stack, events):
        if event.get("kind") == "replica_restarting" and event.get("deployment_id") == (
            deployment_id
        ):
            found.append(event["reason"])
    return found


def serves(stack: Stack, deployment_id: str) -> None:
    _, final = generate(
        stack, timeout=120, deployment_id=deployment_id, prompt="still here", max_tokens=4
    )
    assert final.usage.completion_tokens >= 1


def test_a_worker_killed_mid_stream_heals_without_a_deploy(own_stack, deployment):
    stack, deployment_id = own_stack, deployment.deployment_id
    held = reserved_by_device(stack)
    [pid] = worker_pids(stack, deployment_id)
    stream = Stream(stack, deployment_id)
    assert stream.first.wait(60) and stream.error is None
    os.kill(pid, signal.SIGKILL)
    stream.thread.join(60)
    # The stream in flight is lost, and says so.
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    healed = serving_again(stack, deployment_id, [pid])
    # The agent saw its worker die, the scheduler found it gone, or the deployer's periodic
    # check of what the agents run found it missing: any took it out (and a first try may
    # have found the device's memory not yet republished).
    reasons = restart_reasons(stack, deployment_id)
    assert reasons[0].startswith(
        (
            "worker rank 0 exited (-9)",
            "worker unreachable",
            "its agent reports, rank(s) [0] are not running",
        )
    ), reasons
    assert healed.state_reason.startswith(f"restarted {len(reasons)} time(s) (")
    assert healed.state_reason.endswith(f"against the restart budget); last error: {reasons[-1]}")
    assert healed.worker_address
    # Where people look: `iserve deployments` shows the replica's restarts and last error.
    listed = cli(stack, "deployments", "--model", MODEL)
    assert listed.returncode == 0, listed.stderr
    assert f"READY {healed.worker_address} ({healed.state_reason})" in listed.stdout
    serves(stack, deployment_id)
    # Taken out (memory released) and reserved again: once, as before.
    assert wait_for(lambda: reserved_by_device(stack) == held, timeout=20), (
        reserved_by_device(stack),
        held,
    )


def test_a_worker_that_hangs_mid_stream_fails_its_stream_and_is_replaced(own_stack, deployment):
    stack, deployment_id = own_stack, deployment.deployment_id
    [pid] = worker_pids(stack, deployment_id)
    stream = Stream(stack, deployment_id)
    assert stream.first.wait(60) and stream.error is None
    os.kill(pid, signal.SIGSTOP)  # alive, its sockets open, answering nothing
    try:
        # HTTP/2 keepalive finds the worker silent: the stream fails rather than waiting
        # (300 s, its deadline) for a token that never comes.
        stream.thread.join(60)
        assert not stream.thread.is_alive(), "the stream still waits on a hung worker"
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
        # A worker that answers nothing drains nothing: killed without waiting out the
        # 30 s drain (the restart's note said "in 1 s" for 36 s, a tester).
        assert wait_for(lambda: not _alive(pid), timeout=20), "the hung worker was drained"
        serving_again(stack, deployment_id, [pid])
        assert restart_reasons(stack, deployment_id)[0].startswith("worker unreachable")
        serves(stack, deployment_id)
    finally:
        with contextlib.suppress(ProcessLookupError):  # stopped for good by its agent
            os.kill(pid, signal.SIGCONT)


def test_the_deployer_and_the_scheduler_killed_and_restarted_lose_nothing(own_stack, deployment):
    stack, deployment_id = own_stack, deployment.deployment_id
    before = current(stack, deployment_id)
    pids = worker_pids(stack, deployment_id)
    held = reserved_by_device(stack)
    launcher.restart_service(stack.settings, "deploy", kill=True)
    launcher.restart_service(stack.settings, "scheduler", kill=True)
    after = current(stack, deployment_id)
    assert after.state == READY and after.worker_address == before.worker_address
    serves(stack, deployment_id)
    assert worker_pids(stack, deployment_id) == pids  # the same workers serve
    assert reserved_by_device(stack) == held
    deployments = stack.deployments.ListDeployments(deploy_pb.ListDeploymentsRequest())
    assert deployment_id in {d.deployment_id for d in deployments.deployments}


def test_an_agent_killed_until_its_heartbeat_lapses_is_healed_when_it_is_back(
    own_stack, deployment
):
    """The agent's workers stop with it (they watch their parent); once its heartbeat
    lapses its deployment leaves READY and restarts with backoff until a live agent
    takes it; the new agent starts with no worker of the old one."""
    stack, deployment_id = own_stack, deployment.deployment_id
    held = reserved_by_device(stack)
    pids = worker_pids(stack, deployment_id)
    agent_pid = read_stack_file(stack.settings.state_dir)["pids"]["agent"]
    os.kill(agent_pid, signal.SIGKILL)

    def out_of_service() -> bool:
        now = current(stack, deployment_id)
        return now is not None and now.state != READY

    assert wait_for(out_of_service, timeout=30, interval=0.5)
    assert restart_reasons(stack, deployment_id)[0] == "node agent(s) node0 stopped heartbeating"
    assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=30)
    launcher.restart_service(stack.settings, "agent")
    healed = serving_again(stack, deployment_id, pids)
    # Each try while no agent answered counted against the budget (no live device, or
    # the agent registered but not yet listening).
    reasons = restart_reasons(stack, deployment_id)
    assert all(
        r == "no live devices with room to start it again" or r.startswith("restart failed")
        for r in reasons[1:]
    ), reasons
    assert healed.state_reason.startswith(f"restarted {len(reasons)} time(s)")
    serves(stack, deployment_id)
    assert wait_for(lambda: reserved_by_device(stack) == held, timeout=20)


def test_an_agent_killed_and_started_again_at_once_spends_no_restart_budget(own_stack, deployment):
    """A supervisor (systemd, Kubernetes, a power cycle) starts the agent again before its
    heartbeat lapses. Its workers stopped with it, and the new agent has no record of
    them: the replica was lost with its node, not by a fault of its own. A probe: one
    power loss spent a step of the budget per replica, and a five-replica deployment
    was one step from FAILED."""
    stack, deployment_id = own_stack, deployment.deployment_id
    held = reserved_by_device(stack)
    pids = worker_pids(stack, deployment_id)
    launcher.restart_service(stack.settings, "agent", kill=True)
    serving_again(stack, deployment_id, pids)
    reasons = restart_reasons(stack, deployment_id)
    assert reasons and reasons[0].startswith(
        ("node agent(s) node0 restarted since its workers started", "node agent(s) node0 do not")
    ), reasons
    record = json.loads(with_store(stack, lambda st: st.get_restarts(deployment_id)))
    assert record["in_a_row"] == 0, record
    serves(stack, deployment_id)
    assert wait_for(lambda: reserved_by_device(stack) == held, timeout=20)


def test_an_agent_stopped_on_purpose_is_said_to_be_and_spends_no_restart_budget(
    own_stack, deployment
):
    """A planned stop (SIGTERM: an upgrade, a drained node) of the agent read "node
    agent(s) ... do not answer (worker unreachable ...)", as a crash would (a probe);
    so did one under traffic after that was fixed: a draining worker's refusal reached
    the deployer, through the scheduler, before the agent recorded its stop (a probe)."""
    stack, deployment_id = own_stack, deployment.deployment_id
    held = reserved_by_device(stack)
    pids = worker_pids(stack, deployment_id)
    stop = threading.Event()

    def traffic() -> None:  # back-to-back short requests, refusals and all
        while not stop.is_set():
            with contextlib.suppress(grpc.RpcError, AssertionError):
                generate(stack, deployment_id=deployment_id, prompt="hi", max_tokens=8)

    senders = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
    for sender in senders:
        sender.start()
    try:
        time.sleep(1.0)
        launcher.restart_service(stack.settings, "agent")  # SIGTERM, then started again
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    serving_again(stack, deployment_id, pids)
    reasons = restart_reasons(stack, deployment_id)
    assert reasons and reasons[0].startswith("node agent(s) node0 stopped on purpose"), reasons
    record = json.loads(with_store(stack, lambda st: st.get_restarts(deployment_id)))
    assert record["in_a_row"] == 0, record
    serves(stack, deployment_id)
    assert wait_for(lambda: reserved_by_device(stack) == held, timeout=20)


def test_workers_an_agent_kept_while_it_was_stopped_are_stopped_when_it_is_back(
    own_stack, deployment
):
    """The agent stopped (SIGSTOP: its workers live on) until its heartbeat lapses; the
    deployment is removed meanwhile, which cannot reach it. Once it runs again, the
    deployer sees workers no deployment holds and stops them: they would hold memory
    that is no longer reserved."""
    stack, deployment_id = own_stack, deployment.deployment_id
    held = reserved_by_device(stack)
    pids = worker_pids(stack, deployment_id)
    assert pids
    agent_pid = read_stack_file(stack.settings.state_dir)["pids"]["agent"]
    os.kill(agent_pid, signal.SIGSTOP)
    try:

        def node_dead() -> bool:
            state = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
            return not any(n.alive for n in state.nodes)

        assert wait_for(node_dead, timeout=30, interval=0.5)
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=deployment_id), timeout=60
        )
        assert all(_alive(p) for p in pids)  # out of reach, running on
        assert all(v == 0 for v in reserved_by_device(stack).values())
    finally:
        os.kill(agent_pid, signal.SIGCONT)
    assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=60, interval=0.5)
    assert worker_pids(stack, deployment_id) == []
    assert all(v == 0 for v in reserved_by_device(stack).values()), held


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_redis_down_is_unavailable_streams_go_on_and_state_survives_a_restart(
    own_stack, deployment
):
    stack, deployment_id = own_stack, deployment.deployment_id
    before = current(stack, deployment_id)
    pids = worker_pids(stack, deployment_id)
    held = reserved_by_device(stack)
    recorded = read_stack_file(stack.settings.state_dir)
    port = urlparse(recorded["redis_url"]).port
    stream = Stream(stack, deployment_id)
    assert stream.first.wait(60) and stream.error is None
    os.kill(recorded["pids"]["redis"], signal.SIGKILL)
    try:
        with pytest.raises(grpc.RpcError) as down:
            stack.models.ListModels(model_pb.ListModelsRequest(), timeout=30)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"state store (Redis) unreachable at 127.0.0.1:{port}" in down.value.details()
        with pytest.raises(grpc.RpcError) as down:
            stack.deployments.GetDeployment(
                deploy_pb.GetDeploymentRequest(deployment_id=deployment_id), timeout=30
            )
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "state store (Redis) unreachable" in down.value.details()
        # `iserve status` still shows what answers, and says what could not be told.
        said = cli(stack, "status")
        assert said.returncode == 1 and "SERVICE" in said.stdout, said.stderr
        assert "error: deploy: cluster state: UNAVAILABLE: state store (Redis)" in said.stderr
        time.sleep(6)  # past the heartbeat TTL: the agent could not renew it
    finally:
        redis, _ = start_redis(stack.settings.state_dir / "redis", port=port)
        # With its start time, or `iserve down` takes the new pid for another process's
        # and leaves this Redis running after the test.
        recorded["pids"]["redis"] = redis.pid
        recorded["started"]["redis"] = launcher.start_time(redis.pid)
        (stack.settings.state_dir / "stack.json").write_text(json.dumps(recorded))
    # The stream in flight never needed Redis.
    stream.thread.join(240)
    assert stream.error is None, stream.error
    assert stream.final is not None and stream.final.usage.completion_tokens == LONG
    # Everything is back from the append-only file, and new calls work.
    models = stack.models.ListModels(model_pb.ListModelsRequest(), timeout=30).models
    assert MODEL in {m.model_id for m in models}
    serves(stack, deployment_id)
    # Lapsed heartbeats are not taken for a dead node: the same workers still serve.
    time.sleep(8)
    after = current(stack, deployment_id)
    assert after.state == READY and after.worker_address == before.worker_address
    assert worker_pids(stack, deployment_id) == pids
    assert reserved_by_device(stack) == held


def test_the_whole_stack_stopped_and_started_serves_again(own_stack, deployment):
    """`iserve down` then `iserve up` on the same state directory: Redis comes back from
    its append-only file, the new agent runs no worker, and the deployer restarts the
    deployment instead of leaving it READY with nothing behind it."""
    stack, deployment_id = own_stack, deployment.deployment_id
    held = reserved_by_device(stack)
    pids = worker_pids(stack, deployment_id)
    assert launcher.down(stack.settings, log=lambda _msg: None)
    settings = load_settings()  # no stack.json any more: up starts its own Redis again
    launcher.up(settings, launcher.UpOptions(), log=lambda _msg: None)
    stack.settings = load_settings()
    stack.redis_url = stack.settings.redis_url
    healed = serving_again(stack, deployment_id, pids)
    # A stop on purpose: the replica is restored, and no restart budget is spent.
    reasons = restart_reasons(stack, deployment_id)
    assert reasons == ["the stack was stopped on purpose, rank(s) [0] with it"], reasons
    assert healed.state_reason == "serves again after a stop of the stack"
    # deploy.log says it is restored, not failed (a tester read "reconcile: failed <id>:
    # the stack was stopped on purpose" for a deployment that then served again).
    deploy_log = (stack.settings.state_dir / "logs" / "deploy.log").read_text()
    assert f"reconcile: restoring {deployment_id}: the stack was stopped" in deploy_log
    assert f"reconcile: failed {deployment_id}" not in deploy_log
    serves(stack, deployment_id)
    assert wait_for(lambda: reserved_by_device(stack) == held, timeout=20)
