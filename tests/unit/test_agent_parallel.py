"""The supervisor with tensor/pipeline-parallel deployments: one worker process per rank
(real workers on gloo, a real redis-server), started, served, stopped and failed together."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from monitor_agent.devices import virtual_devices
from monitor_agent.launch import LaunchPlan, WorkerPlan
from monitor_agent.supervisor import CAUSE_WAIT_S, WorkerProcess, WorkerSupervisor
from monitor_agent.worker.exits import EXIT_GROUP_LOST
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.errors import FailedPrecondition
from services.models.checkpoint import create_checkpoint
from services.state.store import StateStore

DEVICES = virtual_devices(2, 1 << 30, [0, 1], "x86_64")
MAX_SEQ_LEN = 128
READY_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return create_checkpoint(
        tmp_path_factory.mktemp("models") / "tiny",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
    )


def _plan(deployment_id: str, checkpoint: Path, tp: int, pp: int, layers) -> LaunchPlan:
    workers = tuple(
        WorkerPlan(stage * tp + t, DEVICES[(stage * tp + t) % 2], *layers[stage])
        for stage in range(pp)
        for t in range(tp)
    )
    return LaunchPlan(
        deployment_id=deployment_id,
        checkpoint_dir=checkpoint,
        dtype="float32",
        max_seq_len=MAX_SEQ_LEN,
        max_batch=2,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        workers=workers,
        ready_timeout_s=READY_TIMEOUT_S,
    )


@pytest.fixture
def run(redis_url, tmp_path):
    """Run ``fn(supervisor, store)`` on a fresh event loop; no worker may outlive it."""

    def runner(fn):
        async def main():
            store = StateStore.from_url(redis_url)
            supervisor = WorkerSupervisor(
                node_id="node-p",
                store=store,
                state_dir=tmp_path,
                bind_host="127.0.0.1",
                advertise_host="127.0.0.1",
            )
            try:
                return await fn(supervisor, store)
            finally:
                await supervisor.stop_all()
                await store.close()

        return asyncio.run(main())

    return runner


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _greedy(address: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb.WorkerServiceGenerateRequest(
            request_id="r",
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=common.SamplingParams(ignore_eos=True),
        )
        return [r.token_ids[0] for r in stub.Generate(request, timeout=60)]


def test_a_pipeline_deployment_serves_the_same_tokens_and_stops(run, checkpoint):
    from monitor_agent.engine.engine import Engine, SamplingConfig

    engine = Engine(checkpoint, max_seq_len=MAX_SEQ_LEN)
    prompt = [1, 17, 230, 5, 99, 412]
    expected = [s.token_id for s in engine.generate(prompt, 10, SamplingConfig(ignore_eos=True))]

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        infos = await supervisor.start_workers(_plan("dep-pp", checkpoint, 1, 2, [(0, 3), (3, 1)]))
        assert [(i.rank, i.state, i.device_id) for i in infos] == [
            (0, agent_pb.WORKER_STATE_READY, "cpu0"),
            (1, agent_pb.WORKER_STATE_READY, "cpu1"),
        ]
        assert infos[0].address.startswith("127.0.0.1:") and infos[1].address == ""
        assert all(i.resident_bytes > 0 for i in infos)
        assert [psutil.Process(i.pid).cpu_affinity() for i in infos] == [[0], [1]]
        got = await asyncio.to_thread(_greedy, infos[0].address, prompt, 10)
        assert got == expected
        # Nothing of the group listens beyond this host (torch's store listened on every
        # interface: a tester).
        listening = [
            (c.laddr.ip, c.laddr.port)
            for i in infos
            for c in psutil.Process(i.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(_loopback(ip) for ip, _ in listening), listening
        stopped = await supervisor.stop_workers("dep-pp")
        assert [(w.state, w.exit_code) for w in stopped] == [(agent_pb.WORKER_STATE_STOPPED, 0)] * 2
        assert not any(_alive(i.pid) for i in infos)

    run(scenario)


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_that_dies_takes_its_group_down(run, checkpoint, victim):
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        deployment_id = f"dep-tp-{victim}"
        infos = await supervisor.start_workers(_plan(deployment_id, checkpoint, 2, 1, [(0, 4)]))
        os.kill(infos[victim].pid, signal.SIGKILL)
        died: list[agent_pb.WorkerInfo] = []
        for _ in range(200):
            died += await supervisor.reap_once()
            if died:
                break
            await asyncio.sleep(0.05)
        assert died[0].rank == victim and died[0].exit_code == -signal.SIGKILL
        survivor = 1 - victim
        # The other rank is gone too: stopped by the supervisor or exited on its own.
        assert not any(_alive(i.pid) for i in infos)
        workers = {w.rank: w for w in supervisor.list_workers(deployment_id)}
        assert workers[survivor].state == agent_pb.WORKER_STATE_FAILED
        events = [
            body
            for _id, body in await store.read_events("0-0", block_ms=10)
            if body["kind"] == "worker_died" and body["deployment_id"] == deployment_id
        ]
        assert events and events[0]["rank"] == victim
        await supervisor.stop_workers(deployment_id)

    run(scenario)


def _group_of(supervisor: WorkerSupervisor, deployment_id: str, tmp_path: Path, *commands):
    """A ready group whose ranks are the processes running ``commands`` (plain Pythons that
    sleep or exit with a worker's codes), as the supervisor tracks it."""
    procs = []
    for rank, code in enumerate(commands):
        popen = subprocess.Popen([sys.executable, "-c", code])
        info = agent_pb.WorkerInfo(
            deployment_id=deployment_id,
            rank=rank,
            pid=popen.pid,
            state=agent_pb.WORKER_STATE_READY,
        )
        plan = WorkerPlan(rank, DEVICES[rank % 2])
        procs.append(
            WorkerProcess(
                deployment_id, plan, popen, tmp_path / f"{rank}.log", tmp_path / "r", info
            )
        )
    supervisor._workers[deployment_id] = procs
    return procs


async def _reap_until_died(supervisor: WorkerSupervisor, seconds: float):
    for _ in range(int(seconds / 0.05)):
        if died := await supervisor.reap_once():
            return died
        await asyncio.sleep(0.05)
    return []


def test_a_rank_that_left_of_a_lost_peer_is_reported_after_the_peer(run, tmp_path):
    """The rank that exits because its group lost another can be reaped first; the rank it
    lost is still reported as the first death, the cause."""
    sleeper = "import time; time.sleep(60)"
    group_lost = f"import sys; sys.exit({EXIT_GROUP_LOST})"

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        victim, survivor = _group_of(supervisor, "dep-order", tmp_path, sleeper, group_lost)
        survivor.popen.wait()
        assert await supervisor.reap_once() == []  # the cause may still show its exit
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait()
        died = await supervisor.reap_once()
        assert [(d.rank, d.exit_code) for d in died] == [(0, -signal.SIGKILL), (1, EXIT_GROUP_LOST)]
        events = await store.read_events("0-0", block_ms=10)
        ours = [(b["kind"], b["rank"]) for _id, b in events if b["deployment_id"] == "dep-order"]
        assert ours == [("worker_died", 0), ("worker_died", 1)]

    run(scenario)


def test_a_rank_that_left_of_a_lost_peer_is_reported_once_the_peer_keeps_running(run, tmp_path):
    """Its peer still running past CAUSE_WAIT_S, the rank that left is reported and the
    peer, which cannot serve alone, is stopped."""
    sleeper = "import time; time.sleep(60)"
    group_lost = f"import sys; sys.exit({EXIT_GROUP_LOST})"

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        peer, left = _group_of(supervisor, "dep-wait", tmp_path, sleeper, group_lost)
        left.popen.wait()
        started = time.monotonic()
        died = await _reap_until_died(supervisor, CAUSE_WAIT_S + 5)
        assert time.monotonic() - started >= CAUSE_WAIT_S
        assert [(d.rank, d.exit_code) for d in died] == [(1, EXIT_GROUP_LOST)]
        assert peer.popen.poll() is not None and peer.info.state == agent_pb.WORKER_STATE_FAILED

    run(scenario)


def test_a_rank_that_exits_as_its_peers_death_is_recorded_is_reported_too(run, tmp_path):
    """Rank 1 exits of rank 0's loss while the reaper writes rank 0's death to Redis:
    it is reported in the same pass, not left READY (it was neither seen exited nor
    alive to be stopped)."""
    failing = "import sys; sys.exit(1)"
    armed = tmp_path / "armed"  # written once the peer's handler is set
    leaves_on_signal = (
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGUSR1, lambda *_: sys.exit({EXIT_GROUP_LOST}))\n"
        f"pathlib.Path({str(armed)!r}).touch()\n"
        "time.sleep(60)"
    )

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        cause, peer = _group_of(supervisor, "dep-meanwhile", tmp_path, failing, leaves_on_signal)
        cause.popen.wait()
        while not armed.exists():
            await asyncio.sleep(0.01)
        put_worker = supervisor._put_worker

        async def peer_leaves_as_it_is_written(info):
            if info.rank == 0 and peer.popen.poll() is None:
                peer.popen.send_signal(signal.SIGUSR1)
                peer.popen.wait()
            await put_worker(info)

        supervisor._put_worker = peer_leaves_as_it_is_written
        counted = []
        supervisor.on_deaths = counted.append  # the agent's iserve_worker_deaths_total
        died = await supervisor.reap_once()
        assert [(d.rank, d.exit_code) for d in died] == [(0, 1), (1, EXIT_GROUP_LOST)]
        assert counted == [2]
        assert [w.state for w in supervisor.list_workers("dep-meanwhile")] == [
            agent_pb.WORKER_STATE_FAILED
        ] * 2

    run(scenario)


def test_stages_that_do_not_tile_the_model_fail_the_start(run, checkpoint):
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        plan = _plan("dep-gap", checkpoint, 1, 2, [(0, 2), (3, 1)])
        with pytest.raises(FailedPrecondition, match="stage 1 starts at layer 3, expected 2"):
            await supervisor.start_workers(plan)
        stored = await store.list_workers("dep-gap")
        assert len(stored) == 2 and not any(_alive(w.pid) for w in stored)
        assert supervisor.list_workers() == []

    run(scenario)
