"""The worker supervisor against real worker processes and a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import psutil
import pytest

from monitor_agent.devices import virtual_devices
from monitor_agent.launch import LaunchPlan, WorkerPlan
from monitor_agent.supervisor import WorkerSupervisor
from monitor_agent.worker_pool import WorkerPool
from services.api import agent_service_pb2 as agent_pb
from services.errors import AlreadyExists, DeadlineExceeded, FailedPrecondition
from services.state.store import StateStore

NODE = "node-t"
DEVICE = virtual_devices(1, 1 << 30, [0], "x86_64")[0]
READY_TIMEOUT_S = 60.0


def _plan(deployment_id: str, checkpoint: Path, ready_timeout_s: float = READY_TIMEOUT_S):
    return LaunchPlan(
        deployment_id=deployment_id,
        checkpoint_dir=checkpoint,
        dtype="float32",
        max_seq_len=256,
        max_batch=1,
        tensor_parallel=1,
        pipeline_parallel=1,
        workers=(WorkerPlan(0, DEVICE),),
        ready_timeout_s=ready_timeout_s,
    )


@pytest.fixture(scope="module")
def pool():
    """The warm worker pool (a fork server with torch imported), shared by the module."""
    warm = WorkerPool()
    warm.start()
    return warm


@pytest.fixture(params=["fresh", "pool"])
def run(request, redis_url, tmp_path):
    """Run ``fn(supervisor, store)`` on a fresh event loop; no worker may outlive it.
    Every test runs twice: workers as fresh processes, and forked from the warm pool."""
    pool = request.getfixturevalue("pool") if request.param == "pool" else None
    return lambda fn: run_with(redis_url, tmp_path, pool, fn)


def run_with(redis_url: str, state_dir: Path, pool: WorkerPool | None, fn):
    """``fn(supervisor, store)`` on a fresh event loop and a clean Redis; every worker is
    stopped afterwards."""

    async def main():
        store = StateStore.from_url(redis_url)
        await store.redis.flushdb()  # the other variant's workers and events
        supervisor = WorkerSupervisor(
            node_id=NODE,
            store=store,
            state_dir=state_dir,
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            drain_timeout_s=1.0,
            pool=pool,
        )
        try:
            return await fn(supervisor, store)
        finally:
            await supervisor.stop_all()
            await store.close()

    return asyncio.run(main())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _died_events(store: StateStore, deployment_id: str) -> list[dict]:
    events = await store.read_events("0-0", block_ms=10)
    return [
        body
        for _id, body in events
        if body["kind"] == "worker_died" and body["deployment_id"] == deployment_id
    ]


def test_workers_start_ready_and_stop_without_leftovers(run, checkpoint, tmp_path):
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        [info] = await supervisor.start_workers(_plan("dep-stop", checkpoint))
        assert info.state == agent_pb.WORKER_STATE_READY
        assert info.address.startswith("127.0.0.1:") and info.pid > 0
        assert info.resident_bytes > 0 and info.device_id == "cpu0"
        assert _alive(info.pid)
        assert psutil.Process(info.pid).cpu_affinity() == [0]

        [stored] = await store.list_workers("dep-stop")
        assert stored.state == agent_pb.WORKER_STATE_READY and stored.address == info.address
        assert [w.pid for w in supervisor.list_workers()] == [info.pid]
        assert supervisor.list_workers("other") == []
        assert supervisor.live_pids("cpu0") == [info.pid]
        assert supervisor.deployments_on("cpu0") == ["dep-stop"]

        with pytest.raises(AlreadyExists, match="already has workers"):
            await supervisor.start_workers(_plan("dep-stop", checkpoint))

        [stopped] = await supervisor.stop_workers("dep-stop")
        assert stopped.state == agent_pb.WORKER_STATE_STOPPED
        assert stopped.exit_code == 0  # SIGTERM is a clean shutdown for a worker
        assert not _alive(info.pid)
        [stored] = await store.list_workers("dep-stop")
        assert stored.state == agent_pb.WORKER_STATE_STOPPED
        assert supervisor.list_workers() == []
        assert list((tmp_path / "run").iterdir()) == []  # no stale ready file
        # Idempotent, and unknown deployments are not an error.
        assert await supervisor.stop_workers("dep-stop") == []
        assert await supervisor.stop_workers("never-started") == []
        assert await _died_events(store, "dep-stop") == []

    run(scenario)


def test_a_killed_worker_is_reported_failed_with_an_event(run, checkpoint):
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        [info] = await supervisor.start_workers(_plan("dep-kill", checkpoint))
        os.kill(info.pid, signal.SIGKILL)
        died = []
        for _ in range(100):
            died = await supervisor.reap_once()
            if died:
                break
            await asyncio.sleep(0.05)
        [dead] = died
        assert dead.state == agent_pb.WORKER_STATE_FAILED
        assert dead.exit_code == -signal.SIGKILL
        assert "killed by SIGKILL" in dead.reason

        [stored] = await store.list_workers("dep-kill")
        assert stored.state == agent_pb.WORKER_STATE_FAILED and stored.exit_code == -9
        [event] = await _died_events(store, "dep-kill")
        assert event["rank"] == 0 and event["exit_code"] == -9 and event["node_id"] == NODE
        assert "SIGKILL" in event["reason"]
        [listed] = supervisor.list_workers("dep-kill")
        assert listed.state == agent_pb.WORKER_STATE_FAILED
        # Reported once only.
        assert await supervisor.reap_once() == []

        [after_stop] = await supervisor.stop_workers("dep-kill")
        assert after_stop.state == agent_pb.WORKER_STATE_FAILED
        assert supervisor.list_workers() == []

    run(scenario)


def test_a_worker_that_cannot_load_fails_the_start_with_its_log_tail(run, checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((checkpoint / name).read_bytes())

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        with pytest.raises(FailedPrecondition) as caught:
            await supervisor.start_workers(_plan("dep-broken", broken))
        message = str(caught.value)
        assert "worker rank 0 of deployment dep-broken exited with code 1" in message
        assert "no *.safetensors files" in message
        [stored] = await store.list_workers("dep-broken")
        assert stored.state == agent_pb.WORKER_STATE_FAILED and stored.exit_code == 1
        assert "no *.safetensors files" in stored.reason
        assert not _alive(stored.pid)
        assert supervisor.list_workers() == []
        assert (tmp_path / "logs" / "worker-dep-broken-r0.log").is_file()

    run(scenario)


def test_a_worker_not_ready_in_time_is_killed(run, checkpoint):
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        # 10 ms: a worker forked from the warm pool can be ready within 0.3 s.
        with pytest.raises(DeadlineExceeded, match=r"not ready within 0.01 s"):
            await supervisor.start_workers(_plan("dep-slow", checkpoint, ready_timeout_s=0.01))
        [stored] = await store.list_workers("dep-slow")
        assert stored.state == agent_pb.WORKER_STATE_FAILED
        assert not _alive(stored.pid)
        assert supervisor.list_workers() == []

    run(scenario)


def test_a_pooled_worker_is_a_fork_of_the_warm_server_in_a_session_of_its_own(
    redis_url, tmp_path, checkpoint, pool
):
    """Forked from the pool: parent is the fork server (not this process), own session,
    its log written, ready, and stopped like any worker; when the fork server dies (the
    agent gone), the worker does not outlive it."""
    from multiprocessing import forkserver

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        [info] = await supervisor.start_workers(_plan("dep-pool", checkpoint))
        worker = psutil.Process(info.pid)
        server = worker.parent()
        assert server is not None and server.pid != os.getpid()
        assert server.pid == forkserver._forkserver._forkserver_pid
        assert os.getsid(info.pid) == info.pid
        assert (tmp_path / "logs" / "worker-dep-pool-r0.log").stat().st_size > 0
        # The agent's death takes the fork server with it; then the worker leaves.
        server.kill()
        for _ in range(200):
            if not _alive(info.pid):
                break
            await asyncio.sleep(0.05)
        assert not _alive(info.pid)

    run_with(redis_url, tmp_path, pool, scenario)
