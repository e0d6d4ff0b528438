"""The worker supervisor against real worker processes and a real redis-server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import signal
import time
from pathlib import Path

import grpc
import psutil
import pytest

from monitor_agent import supervisor as supervisor_module
from monitor_agent.devices import DeviceSpec, virtual_devices
from monitor_agent.launch import LaunchPlan, WorkerPlan
from monitor_agent.supervisor import WorkerSupervisor, log_tail, prune_stopped_logs
from monitor_agent.worker_pool import WorkerPool
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.errors import AlreadyExists, DeadlineExceeded, FailedPrecondition, Unavailable
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
        assert await store.redis.ttl("iserve:workers:dep-stop") == -1  # kept: no expiry
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


def test_only_the_newest_stopped_deployments_logs_are_kept(tmp_path):
    """Every deployment ever made left its workers' logs for good (a tester's 30 cycles);
    running groups (this agent's, or with another agent's ready file) and profiling
    jobs' logs are never pruned here, however old."""
    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    logs.mkdir()
    run_dir.mkdir()
    stopped = [
        [logs / f"worker-m-{i:02d}-r0.log", logs / f"worker-m-{i:02d}-r1.log"] for i in range(6)
    ]
    stopped[0].append(logs / "worker-m-00-r0.log.1")  # a restart's earlier log
    replica = [logs / "worker-m-05.r1-r0.log"]
    mine, theirs = logs / "worker-live-a-r0.log", logs / "worker-live-b-r0.log"
    others = [logs / "agent.log", logs / "worker-profile-0a1b-r0.log", logs / "worker-x.log"]
    (run_dir / "worker-live-b-r0.ready.json").write_text("{}")
    ordered = [mine, theirs, *others, *[f for group in stopped for f in group], *replica]
    for age, path in enumerate(ordered):  # the live ones and the others the oldest
        path.write_text("x")
        os.utime(path, ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    removed = prune_stopped_logs(logs, run_dir, {"live-a"}, keep=3)
    # Kept: the replica group m-05.r1, m-05 and m-04 (the newest three groups).
    assert sorted(removed) == sorted(f for group in stopped[:4] for f in group)
    assert sorted(logs.iterdir()) == sorted(
        [mine, theirs, *others, *stopped[4], *stopped[5], *replica]
    )
    assert prune_stopped_logs(logs, run_dir, {"live-a"}, keep=3) == []


def test_a_stop_prunes_the_logs_of_older_stopped_deployments(run, checkpoint, monkeypatch):
    monkeypatch.setattr(supervisor_module, "KEPT_STOPPED_LOGS", 1)

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        old = supervisor.log_dir / "worker-gone-1a2b-r0.log"
        supervisor.log_dir.mkdir(parents=True, exist_ok=True)
        old.write_text("a deployment removed long ago")
        os.utime(old, ns=(1, 1))
        await supervisor.start_workers(_plan("dep-pruned", checkpoint))
        assert old.is_file()  # a start prunes nothing
        await supervisor.stop_workers("dep-pruned")
        assert not old.exists()
        assert (supervisor.log_dir / "worker-dep-pruned-r0.log").is_file()  # the newest

    run(scenario)


def test_workers_serve_on_the_configured_ports_and_give_them_back(run, checkpoint):
    """ISERVE_WORKER_PORTS, for a firewall between nodes: each worker serves on a port of
    the range no other live worker holds, and a stopped one's is free again."""
    from services.ports import bindable, free_port

    low = free_port()
    while not bindable("127.0.0.1", low + 1):  # two free ports side by side, on any machine
        low = free_port()
    span = range(low, low + 2)

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        supervisor.worker_ports = span
        [one] = await supervisor.start_workers(_plan("dep-port-1", checkpoint))
        [two] = await supervisor.start_workers(_plan("dep-port-2", checkpoint))
        ports = {int(w.address.rsplit(":", 1)[1]) for w in (one, two)}
        assert ports == set(span)
        with pytest.raises(Unavailable, match=f"no free port in {low}-{low + 1}"):
            await supervisor.start_workers(_plan("dep-port-3", checkpoint))
        await supervisor.stop_workers("dep-port-1")
        [three] = await supervisor.start_workers(_plan("dep-port-3", checkpoint))
        assert three.address == one.address  # given back, and taken again

    run(scenario)


def test_a_profiling_jobs_worker_records_expire_should_its_agent_die(run, checkpoint):
    """A probe killed the agent mid-profiling: the job's worker record (STARTING, its pid
    long gone) stayed in Redis through restarts and the model's deletion; no one else
    knows its group. A plan that says so has its records expire."""
    from dataclasses import replace

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        plan = replace(_plan("profile-expiring", checkpoint), records_expire_s=3600.0)
        await supervisor.start_workers(plan)
        assert 3500 < await store.redis.ttl("iserve:workers:profile-expiring") <= 3600
        await supervisor.stop_workers("profile-expiring")
        assert 3500 < await store.redis.ttl("iserve:workers:profile-expiring") <= 3600

    run(scenario)


def worker_log(supervisor: WorkerSupervisor, deployment_id: str) -> str:
    [proc] = supervisor._workers[deployment_id]
    return proc.log_path.read_text(errors="replace")


def test_a_death_s_log_tail_keeps_what_is_not_routine(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text(
        "2026-11-29 01:30:27,489 INFO worker[d] iserve.grpc: d listening on 127.0.0.1:0\n"
        "2026-11-29 01:30:28,000 WARNING worker[d] iserve.engine: KV cache nearly full\n"
        "Fatal Python error: Segmentation fault\n"
        "2026-11-29 01:30:29,000 DEBUG worker[d] iserve.engine: step\n"
    )
    assert log_tail(log, routine=False) == (
        "2026-11-29 01:30:28,000 WARNING worker[d] iserve.engine: KV cache nearly full\n"
        "Fatal Python error: Segmentation fault"
    )
    assert log_tail(log).count("\n") == 3


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
        # Its log holds only routine records ("... listening on ..."), which say nothing
        # of the kill: the reason quotes none of them (a tester).
        assert "listening on" in worker_log(supervisor, "dep-kill")
        assert dead.reason == "killed by SIGKILL", dead.reason

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


def test_a_pooled_worker_the_process_table_shows_gone_is_not_read_as_running():
    """The fork server reaps a worker, then writes its exit code to a pipe: a stop that
    polled in between read "still running", and recorded a worker killed mid-stream as
    stopped, its cause lost (a CI run, the test below's pool variant)."""
    import subprocess
    import sys

    from monitor_agent.worker_pool import PooledProcess

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)  # reaped: no such process now

    class CodeOnItsWay:  # multiprocessing's process before the pipe was read
        pid = gone.pid
        exitcode = None

        def join(self, timeout=None):
            self.exitcode = -signal.SIGKILL

    assert PooledProcess(CodeOnItsWay()).poll() == -signal.SIGKILL

    class Running(CodeOnItsWay):
        pid = os.getpid()

        def join(self, timeout=None):
            raise AssertionError("a running worker is not waited for")

    assert PooledProcess(Running()).poll() is None


def test_a_stop_while_the_reaper_records_a_death_keeps_its_cause(run, checkpoint):
    """The reaper was writing a SIGKILLed worker's record (FAILED, its cause) when the
    deployer's stop came: the stop marked it STOPPED over it (a CI run). The stop now
    waits for that record."""

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        [info] = await supervisor.start_workers(_plan("dep-racing", checkpoint))
        os.kill(info.pid, signal.SIGKILL)
        while _alive(info.pid):
            await asyncio.sleep(0.01)
        gate, put = asyncio.Event(), store.put_worker

        async def slow_put(record, *args, **kwargs):
            if record.state == agent_pb.WORKER_STATE_FAILED:
                await gate.wait()  # the reaper's write, held while the stop comes
            return await put(record, *args, **kwargs)

        store.put_worker = slow_put
        reaping = asyncio.ensure_future(supervisor.reap_once())
        await asyncio.sleep(0.2)
        stopping = asyncio.ensure_future(supervisor.stop_workers("dep-racing"))
        answered, _ = await asyncio.wait({stopping}, timeout=1.0)
        # Answered while the death was still being recorded, it said STOPPED.
        early = [w.state for w in stopping.result()] if answered else None
        gate.set()
        await reaping
        [stopped] = await stopping
        assert early in (None, [agent_pb.WORKER_STATE_FAILED]), early
        assert stopped.state == agent_pb.WORKER_STATE_FAILED
        assert "killed by SIGKILL" in stopped.reason
        [stored] = await store.list_workers("dep-racing")
        assert stored.state == agent_pb.WORKER_STATE_FAILED

    run(scenario)


def test_a_worker_dead_before_its_stop_is_recorded_with_its_cause(run, checkpoint, caplog):
    """A worker killed mid-stream is reported by the scheduler, and the deployer's stop
    can come before the reaper saw the exit: the stop still records it FAILED with its
    exit code and logs the death (a probe found only "1 worker(s) stopped"), and
    publishes no worker_died event (the stop is the deployer's answer to the death)."""

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        [info] = await supervisor.start_workers(_plan("dep-gone", checkpoint))
        os.kill(info.pid, signal.SIGKILL)
        while _alive(info.pid):
            await asyncio.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="iserve.agent.supervisor"):
            [stopped] = await supervisor.stop_workers("dep-gone")
        assert stopped.state == agent_pb.WORKER_STATE_FAILED
        assert stopped.exit_code == -signal.SIGKILL and "killed by SIGKILL" in stopped.reason
        [stored] = await store.list_workers("dep-gone")
        assert stored.state == agent_pb.WORKER_STATE_FAILED and stored.exit_code == -9
        assert await _died_events(store, "dep-gone") == []
        assert any(
            "dep-gone rank 0" in r.getMessage() and "died" in r.getMessage() for r in caplog.records
        )

    run(scenario)


# A process with threads and a gigabyte of touched memory, as a worker is: killed, its
# main thread is a zombie while the others still exit, and waitpid has nothing to give.
_HEAVY = (
    "import threading, time\n"
    "ballast = bytearray(1 << 30)\n"
    "def spin():\n    while True:\n        pass\n"
    "for _ in range(4):\n    threading.Thread(target=spin, daemon=True).start()\n"
    "print('up', flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_stop_reads_the_exit_code_of_a_worker_that_shows_exited_but_cannot_be_waited_for():
    """The process table shows a killed worker exited (its main thread a zombie) for tens
    of milliseconds before its exit code can be read: a stop that came then took it for
    running and recorded it STOPPED, the SIGKILL lost (a loaded CI run of the test
    above). The stop now waits for the code."""
    import subprocess
    import sys
    from types import SimpleNamespace

    windows = 0
    for _ in range(3):
        popen = subprocess.Popen([sys.executable, "-c", _HEAVY], stdout=subprocess.PIPE)
        try:
            assert popen.stdout.readline() == b"up\n"
            rank = SimpleNamespace(
                popen=popen,
                stopping=False,
                host=None,
                info=agent_pb.WorkerInfo(state=agent_pb.WORKER_STATE_READY),
            )
            popen.kill()
            while _alive(popen.pid):
                pass
            windows += popen.poll() is None  # the process table ahead of waitpid
            asyncio.run(supervisor_module._exit_codes_readable([rank]))
            assert popen.poll() == -signal.SIGKILL
        finally:
            popen.kill()
            popen.wait()
    if not windows:
        pytest.skip("the exit code was readable at once each time (no window to close)")


@pytest.mark.parametrize("when", ["spawning", "loading"])
def test_workers_stopped_while_they_start_are_all_stopped(run, checkpoint, when):
    """A Remove while its deployment started: the agent's stop came while the rank was
    being spawned, so it found none, and the rank then ran on untracked (a probe found
    both ranks of a tp = 2 group alive after the Remove, holding memory nothing
    reserved). The start now fails and leaves no worker."""

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        starting = asyncio.create_task(supervisor.start_workers(_plan("dep-race", checkpoint)))

        def started() -> bool:
            if when == "loading":  # its rank spawned, loading the model
                return bool(supervisor._workers.get("dep-race"))
            return "dep-race" in supervisor._workers  # claimed, the rank being spawned

        while not started():
            await asyncio.sleep(0.001)
        await supervisor.stop_workers("dep-race")
        with pytest.raises(FailedPrecondition):
            await starting
        stored = await store.list_workers("dep-race")
        assert stored and not any(_alive(w.pid) for w in stored)
        assert supervisor.list_workers() == []

    run(scenario)


def test_a_worker_whose_log_cannot_be_opened_fails_the_start_naming_it(run, checkpoint, tmp_path):
    """A forked worker opened its log itself: when it could not, it exited 1 and the
    failure quoted the tail of the log it could not write (a probe saw a previous run's
    "ready ... stopped" as the reason). The agent opens it first, for both kinds."""
    (tmp_path / "logs" / "worker-dep-log-r0.log").mkdir(parents=True)

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        with pytest.raises(Unavailable, match=r"cannot start worker rank 0: .*worker-dep-log-r0"):
            await supervisor.start_workers(_plan("dep-log", checkpoint))
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


def test_a_worker_started_again_keeps_its_predecessor_s_log(run, checkpoint, tmp_path):
    """A replica restarted after a crash (or restored by a new agent) writes the same
    log: the dead worker's log is moved to ``.1`` first, not truncated (a probe found the
    post-mortem of a worker killed mid-stream gone within a second)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((checkpoint / name).read_bytes())
    log_path = tmp_path / "logs" / "worker-dep-again-r0.log"

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        with pytest.raises(FailedPrecondition):
            await supervisor.start_workers(_plan("dep-again", broken))
        first = log_path.read_text()
        assert "no *.safetensors files" in first
        await supervisor.start_workers(_plan("dep-again", checkpoint))
        assert log_path.with_name(log_path.name + ".1").read_text() == first
        assert "no *.safetensors files" not in log_path.read_text()

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


def test_an_agent_stopping_with_redis_gone_stops_its_workers_and_logs_no_traceback(
    redis_url, tmp_path, checkpoint, caplog
):
    """`iserve down` after Redis died: each deployment's stop wrote an ERROR with a
    traceback (the worker records could not be written), though its workers had
    stopped. The workers stop, and the missing records are one warning line."""
    import logging

    from services.state.store import StateStoreUnavailable

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        [info] = await supervisor.start_workers(_plan("dep-redis-gone", checkpoint))

        async def unreachable(*args, **kwargs):
            raise StateStoreUnavailable("state store (Redis) unreachable at test")

        store.put_worker = unreachable
        with caplog.at_level(logging.WARNING, logger="iserve.agent.supervisor"):
            await supervisor.stop_all()
        assert not _alive(info.pid)
        records = [r for r in caplog.records if r.name == "iserve.agent.supervisor"]
        assert [r.levelno for r in records] == [logging.WARNING], records
        assert records[0].exc_info is None
        assert "dep-redis-gone: workers stopped, their records not written" in records[0].message

    run_with(redis_url, tmp_path, None, scenario)


# --- a TensorRT-LLM group: one process for every rank ----------------------------------
# No GPU and no TensorRT-LLM here: the worker runs the TensorRT-LLM engine over the
# stand-in package in trtllm_stand_in/ (put on its PYTHONPATH), on devices the plan calls
# CUDA GPUs. What this shows is the supervisor's side: one process, every rank listed.

STAND_IN = Path(__file__).parent / "trtllm_stand_in"
# Two of the cores this process may use (whichever this machine allows), two GPUs each.
CORES = sorted(os.sched_getaffinity(0))[:2]
GPUS = tuple(
    DeviceSpec(
        f"cuda{i}", common.DEVICE_KIND_CUDA, "H100", "h100", 80 << 30, (CORES[i % len(CORES)],), i
    )
    for i in range(4)
)


def _group_plan(deployment_id: str, checkpoint: Path) -> LaunchPlan:
    """tp=2 × pp=2 over four stand-in GPUs, a layer per stage of the 2-layer checkpoint."""
    return LaunchPlan(
        deployment_id=deployment_id,
        checkpoint_dir=checkpoint,
        dtype="float32",
        max_seq_len=256,
        max_batch=1,
        tensor_parallel=2,
        pipeline_parallel=2,
        workers=tuple(WorkerPlan(r, GPUS[r], r // 2, 1) for r in range(4)),
        ready_timeout_s=READY_TIMEOUT_S,
        engine="tensorrt_llm",
    )


@pytest.fixture
def stand_in(monkeypatch, tmp_path) -> Path:
    """Workers started from now on import the stand-in tensorrt_llm; returns the file its
    LLM records its arguments in."""
    record = tmp_path / "llm-calls.jsonl"
    path = os.pathsep.join(filter(None, [str(STAND_IN), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("TRTLLM_STAND_IN_RECORD", str(record))
    return record


def _generate(address: str, max_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stub = worker_service_pb2_grpc.WorkerServiceStub(ch)
        request = worker_pb.WorkerServiceGenerateRequest(
            request_id="r", prompt_token_ids=[1, 17, 230], max_tokens=max_tokens
        )
        return [t for reply in stub.Generate(request, timeout=30) for t in reply.token_ids]


def test_a_tensorrt_llm_group_is_one_process_listed_as_every_rank(
    redis_url, tmp_path, checkpoint, stand_in
):
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        infos = await supervisor.start_workers(_group_plan("dep-trt", checkpoint))
        assert [(i.rank, i.device_id, i.state) for i in infos] == [
            (r, f"cuda{r}", agent_pb.WORKER_STATE_READY) for r in range(4)
        ]
        pid = infos[0].pid
        assert {i.pid for i in infos} == {pid} and _alive(pid)
        assert infos[0].address.startswith("127.0.0.1:")
        assert [i.address for i in infos[1:]] == ["", "", ""]  # only rank 0 serves
        # The engine's own account: 1 GiB of each stand-in GPU, all reported by rank 0.
        assert [i.resident_bytes for i in infos] == [4 << 30, 0, 0, 0]
        assert psutil.Process(pid).cpu_affinity() == CORES  # every device's cores
        # One process, one log: rank 0's.
        assert [p.name for p in (tmp_path / "logs").iterdir()] == ["worker-dep-trt-r0.log"]
        stored = await store.list_workers("dep-trt")
        assert sorted((w.rank, w.pid, w.state) for w in stored) == [
            (r, pid, agent_pb.WORKER_STATE_READY) for r in range(4)
        ]
        assert supervisor.list_workers("dep-trt") == infos
        assert supervisor.deployments_on("cuda3") == ["dep-trt"]
        # TensorRT-LLM was asked for the whole group, from that one process.
        [built] = [json.loads(line) for line in stand_in.read_text().splitlines()]
        kwargs = built["kwargs"]
        assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (2, 2)
        assert kwargs["pp_partition"] == [1, 1]
        assert await asyncio.to_thread(_generate, infos[0].address, 5) == [21, 22, 23, 24, 25]

        stopped = await supervisor.stop_workers("dep-trt")
        assert [(w.rank, w.state, w.exit_code) for w in stopped] == [
            (r, agent_pb.WORKER_STATE_STOPPED, 0) for r in range(4)
        ]
        assert not _alive(pid)
        stored = await store.list_workers("dep-trt")
        assert {w.state for w in stored} == {agent_pb.WORKER_STATE_STOPPED}
        assert supervisor.list_workers() == []
        assert await _died_events(store, "dep-trt") == []

    run_with(redis_url, tmp_path, None, scenario)


def test_a_tensorrt_llm_group_dies_with_its_process(redis_url, tmp_path, checkpoint, stand_in):
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        infos = await supervisor.start_workers(_group_plan("dep-trt-kill", checkpoint))
        os.kill(infos[0].pid, signal.SIGKILL)
        died = []
        for _ in range(100):
            died = await supervisor.reap_once()
            if died:
                break
            await asyncio.sleep(0.05)
        # One death, rank 0's process; the ranks it ran follow it.
        assert [(d.rank, d.exit_code) for d in died] == [(0, -signal.SIGKILL)]
        listed = supervisor.list_workers("dep-trt-kill")
        assert [(w.rank, w.state, w.exit_code) for w in listed] == [
            (r, agent_pb.WORKER_STATE_FAILED, -signal.SIGKILL) for r in range(4)
        ]
        for hosted in listed[1:]:
            assert hosted.reason.startswith("rank 0's process, which ran this rank, killed by")
        stored = await store.list_workers("dep-trt-kill")
        assert {w.state for w in stored} == {agent_pb.WORKER_STATE_FAILED}
        [event] = await _died_events(store, "dep-trt-kill")
        assert event["rank"] == 0
        assert await supervisor.reap_once() == []
        after = await supervisor.stop_workers("dep-trt-kill")
        assert {w.state for w in after} == {agent_pb.WORKER_STATE_FAILED}

    run_with(redis_url, tmp_path, None, scenario)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed"
)
def test_a_tensorrt_llm_group_that_cannot_start_fails_every_rank(redis_url, tmp_path, checkpoint):
    # No stand-in on the worker's path: it finds no tensorrt_llm and says so.
    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        with pytest.raises(FailedPrecondition) as caught:
            await supervisor.start_workers(_group_plan("dep-trt-bad", checkpoint))
        message = str(caught.value)
        assert "worker rank 0 of deployment dep-trt-bad exited with code 2" in message
        assert "tensorrt_llm is not installed" in message
        stored = await store.list_workers("dep-trt-bad")
        assert sorted((w.rank, w.state) for w in stored) == [
            (r, agent_pb.WORKER_STATE_FAILED) for r in range(4)
        ]
        assert supervisor.list_workers() == []

    run_with(redis_url, tmp_path, None, scenario)


def test_a_group_that_lost_a_rank_is_stopped_without_its_drain(run, checkpoint):
    """A rank blocked on a peer whose node died cannot act on SIGTERM: it was given the
    whole drain and margin (35 s by default) before SIGKILL, and the dead node's other
    replicas waited behind it (a multi-host probe)."""

    async def scenario(supervisor: WorkerSupervisor, store: StateStore):
        supervisor.stop_timeout_s = 30.0  # the default drain's, not this fixture's
        [info] = await supervisor.start_workers(_plan("dep-lost", checkpoint))
        os.kill(info.pid, signal.SIGSTOP)  # blocked: it cannot handle SIGTERM
        started = time.monotonic()
        [stopped] = await supervisor.stop_workers("dep-lost", lost_rank=True)
        assert time.monotonic() - started < 10
        assert stopped.exit_code == -signal.SIGKILL

    run(scenario)


def test_ready_files_of_workers_gone_are_removed_and_live_ones_kept(tmp_path):
    """An agent killed while a worker started left its ready file for good, naming a pid
    that may be reused."""
    supervisor = WorkerSupervisor(
        node_id="n", store=None, state_dir=tmp_path, bind_host="127.0.0.1", advertise_host="x"
    )
    run = tmp_path / "run"
    run.mkdir()
    gone = psutil.Popen(["true"])
    gone.wait()
    (run / "worker-a-r0.ready.json").write_text(json.dumps({"port": 1, "pid": gone.pid}))
    (run / "worker-b-r0.ready.json").write_text(json.dumps({"port": 1, "pid": os.getpid()}))
    (run / "worker-c-r0.ready.json").write_text("{")  # being written: left alone
    assert supervisor.remove_stale_ready_files() == [run / "worker-a-r0.ready.json"]
    assert sorted(p.name for p in run.iterdir()) == [
        "worker-b-r0.ready.json",
        "worker-c-r0.ready.json",
    ]


def test_a_stopped_pool_leaves_no_fork_server_behind_and_starts_again(pool):
    """`iserve down` returned while the agent's fork server still ran for seconds (it
    sees the agent go only after what it is doing). The agent stops it on its way out;
    a pool stopped and started again forks from a new one."""
    from multiprocessing import forkserver

    pool.start()
    first = forkserver._forkserver._forkserver_pid
    assert first is not None and _alive(first)
    pool.stop()
    assert not _alive(first)
    pool.stop()  # stopped already: nothing to do
    pool.start()
    second = forkserver._forkserver._forkserver_pid
    assert second not in (None, first) and _alive(second)


def test_the_reaper_says_once_that_redis_is_down_and_once_that_it_is_back(tmp_path, caplog):
    """A tester counted 45 tracebacks in the agent's log in 20 s of Redis down."""
    from services.state.store import StateStoreUnavailable

    supervisor = WorkerSupervisor(
        node_id=NODE,
        store=None,
        state_dir=tmp_path,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        reap_interval_s=0.001,
    )
    rounds = 0

    async def reap_once():
        nonlocal rounds
        rounds += 1
        if rounds <= 20:
            raise StateStoreUnavailable("state store (Redis) unreachable at 127.0.0.1:1")
        return []

    supervisor.reap_once = reap_once

    async def scenario():
        task = asyncio.create_task(supervisor.reap_forever())
        while rounds < 25:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="iserve.agent.supervisor"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "reaping workers failed" in m] == [
        "reaping workers failed, retrying each round: "
        "state store (Redis) unreachable at 127.0.0.1:1"
    ]
    assert not any(r.exc_info for r in caplog.records)
    assert said.count("reaping workers works again") == 1
