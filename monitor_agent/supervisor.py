"""Starts, watches and stops this node's worker processes.

Each worker runs ``python -m monitor_agent.worker`` in its own session (so a signal to its
process group reaches anything it spawns), logs to
``<state_dir>/logs/worker-<deployment>-r<rank>.log`` and reports readiness by writing a
ready file (see ``monitor_agent.worker.process``). The supervisor records every worker in
Redis (STARTING -> READY -> STOPPED, or FAILED with the exit code and the tail of its
log) and publishes a ``worker_died`` event when a ready worker exits unasked.

A tensor/pipeline-parallel deployment is one process per rank, each pinned to its own
device's cores. When the request names no rendezvous address and this node runs every
rank, the supervisor picks a free local port for the torch.distributed store. The start
succeeds once every rank's ready file exists (which the ranks write only after the whole
group has formed and loaded); if any rank exits first, or time runs out, all are stopped.
A rank that dies later is reported as above, and the supervisor stops the deployment's
other ranks on this node (recorded FAILED), since a group missing a rank cannot serve.

A TensorRT-LLM group (``plan.engine``) is one process, rank 0's, which starts the other
ranks itself: the supervisor spawns rank 0 alone (no rendezvous) and records every other
rank as hosted by it (same pid, no address, its state following rank 0's), so ListWorkers
still shows the whole group. Rank 0's exit, asked or not, ends the hosted ranks with it;
only rank 0's death is a ``worker_died`` event.

Stopping a deployment drains it: SIGTERM goes to rank 0 first, which finishes the
generations in flight within ``drain_timeout_s`` (passed to it as ``--drain-timeout-s``)
and then tells the other ranks to stop; whatever is still alive after the drain plus
``services.drain.WORKER_STOP_MARGIN_S`` gets SIGKILL. A worker with nothing in flight exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from monitor_agent.launch import LaunchPlan, WorkerPlan
from monitor_agent.shm_files import remove_shared_files
from monitor_agent.worker.exits import EXIT_GROUP_LOST
from monitor_agent.worker_pool import (
    REAPED_CODE_WAIT_S,
    PooledProcess,
    WorkerPool,
    process_running,
    worker_environment,
)
from services.api import agent_service_pb2 as agent_pb
from services.drain import WORKER_STOP_MARGIN_S
from services.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Unavailable,
    WorkerKilled,
)
from services.exits import describe_exit
from services.grpc_server import is_routine_record
from services.ports import free_port, free_port_in
from services.retry_log import RetryLog
from services.settings import DEFAULT_DRAIN_TIMEOUT_S
from services.state.store import StateStore, StateStoreUnavailable

log = logging.getLogger("iserve.agent.supervisor")

PROJECT_ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES = 12
# How long a worker of a group that lost a rank on another node gets after SIGTERM.
LOST_RANK_GRACE_S = 1.0
# How long the reaper waits for the rank a group lost to show its exit, once another rank
# has exited of losing it, so that the cause is reported first.
CAUSE_WAIT_S = 2.0
_LOG_TAIL_BYTES = 8192
_POLL_S = 0.05
# The worker logs kept of deployment groups no longer running here, the most recently
# written groups': each deployment ever made left one a rank for good (a tester's 30
# deploy-and-remove cycles, 30 more files). Profiling jobs' are pruned on their own
# (monitor_agent.profiling.KEPT_JOB_LOGS).
KEPT_STOPPED_LOGS = 64
_WORKER_LOG = re.compile(r"^worker-(?P<group>.+)-r\d+\.log(?:\.\d+)?$")


def keep_previous_log(log_path: Path) -> None:
    """Move a worker's log aside to ``<name>.1`` (replacing the one before) before a new
    process of the same deployment and rank writes it: a replica restarted after a crash,
    or restored by a new agent, truncated the dead worker's log, its post-mortem."""
    if log_path.is_file() and log_path.stat().st_size:
        os.replace(log_path, log_path.with_name(log_path.name + ".1"))


def prune_stopped_logs(
    log_dir: Path, run_dir: Path, running: Collection[str], keep: int = KEPT_STOPPED_LOGS
) -> list[Path]:
    """Remove the worker logs of the deployment groups that run nowhere (not in
    ``running``, this agent's, nor with a ready file in ``run_dir``, which another agent
    sharing the directory writes for its live workers), all but the ``keep`` most
    recently written groups'; returns those removed. Profiling jobs' are left alone."""
    live = set(running)
    for path in run_dir.glob("worker-*.ready.json"):
        match = _WORKER_LOG.match(path.name.removesuffix(".ready.json") + ".log")
        if match:
            live.add(match["group"])
    written: dict[str, int] = {}
    files: dict[str, list[Path]] = defaultdict(list)
    for path in log_dir.glob("worker-*.log*"):
        match = _WORKER_LOG.match(path.name)
        if not match or match["group"] in live or match["group"].startswith("profile-"):
            continue
        with contextlib.suppress(OSError):  # removed meanwhile
            mtime = path.stat().st_mtime_ns
            files[match["group"]].append(path)
            written[match["group"]] = max(written.get(match["group"], 0), mtime)
    removed = []
    for group in sorted(written, key=written.__getitem__, reverse=True)[keep:]:
        for path in files[group]:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


@dataclass
class WorkerProcess:
    """One worker process and what the agent knows about it."""

    deployment_id: str
    plan: WorkerPlan
    popen: subprocess.Popen | PooledProcess
    log_path: Path
    ready_file: Path
    info: agent_pb.WorkerInfo
    # Set once the agent asked it to stop, so its exit is not reported as a death.
    stopping: bool = False
    # The process that runs this rank when it has none of its own (a TensorRT-LLM
    # group's ranks other than 0); ``popen`` is then the host's.
    host: WorkerProcess | None = None
    # Whether what the exited process could not remove itself has been removed.
    swept: bool = False
    # Set while its death is being recorded, so that it is recorded once.
    reporting_death: bool = False
    # How long its log was when it became ready: a death's reason quotes what came after.
    ready_log_bytes: int = 0

    @property
    def alive(self) -> bool:
        """Whether the process runs; the first call that finds it exited removes the
        shared-memory file it may have left (a rank 0 killed while its group set up)."""
        if self.popen.poll() is None:
            return True
        if not self.swept:
            self.swept = True
            for path in remove_shared_files(self.popen.pid):
                log.info("removed %s, left by worker pid %d", path, self.popen.pid)
        return False


def log_tail(
    path: Path, lines: int = LOG_TAIL_LINES, *, since: int = 0, routine: bool = True
) -> str:
    """The last ``lines`` non-empty lines of a log file after its first ``since`` bytes
    ('' when there is none); without ``routine``, leaving out the process's INFO and
    DEBUG records: none says why a worker died (a SIGKILLed worker's reason quoted its
    "listening on" line, a tester), while a traceback, an error, a warning or
    faulthandler's dump stay."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(since, fh.tell() - _LOG_TAIL_BYTES))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    kept = [
        line
        for line in text.splitlines()
        if line.strip() and (routine or not is_routine_record(line))
    ]
    return "\n".join(kept[-lines:])


def read_ready_file(path: Path) -> dict | None:
    """The worker's ready record, or None while it has not been written."""
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "port" in record else None


def _copy(info: agent_pb.WorkerInfo) -> agent_pb.WorkerInfo:
    copy = agent_pb.WorkerInfo()
    copy.CopyFrom(info)
    return copy


class WorkerSupervisor:
    """Owns the worker processes of this node; every method runs on the agent's loop."""

    def __init__(
        self,
        *,
        node_id: str,
        store: StateStore,
        state_dir: Path,
        bind_host: str,
        advertise_host: str,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        reap_interval_s: float = 0.3,
        pool: WorkerPool | None = None,
        worker_ports: range | None = None,
    ):
        self.node_id = node_id
        self.store = store
        self.log_dir = state_dir / "logs"
        self.run_dir = state_dir / "run"
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.drain_timeout_s = drain_timeout_s
        self.stop_timeout_s = drain_timeout_s + WORKER_STOP_MARGIN_S
        self.reap_interval_s = reap_interval_s
        self.pool = pool
        # The ports workers serve on (ISERVE_WORKER_PORTS; None: any), and those handed
        # to workers of deployments that have not been stopped, port -> deployment id:
        # handed under the lock, as ranks of several deployments spawn in threads at once.
        self.worker_ports = worker_ports
        self._ports_handed: dict[int, str] = {}
        self._ports_lock = threading.Lock()
        # Told how many ranks each reaping found dead unasked (the agent's metrics).
        self.on_deaths: Callable[[int], None] = lambda count: None
        self._workers: dict[str, list[WorkerProcess]] = {}
        # Deployment id -> seconds its workers' records outlive their last write
        # (LaunchPlan.records_expire_s), for the groups that set one.
        self._records_expire_s: dict[str, float] = {}
        # Deployment id -> when a rank was first seen exited of a lost peer (_cause_may_follow).
        self._consequence_seen: dict[str, float] = {}
        self._disowned = False

    def disown(self) -> None:
        """Write no more worker records or events: another agent holds this node id now
        (NodeTakenOver), and the records under it are that agent's, which its workers of
        the same deployments and ranks would have read as stopped."""
        self._disowned = True

    async def _put_worker(self, info: agent_pb.WorkerInfo) -> None:
        if self._disowned:
            return
        await self.store.put_worker(info, self._records_expire_s.get(info.deployment_id, 0.0))

    def remove_stale_ready_files(self) -> list[Path]:
        """Remove the ready files of workers that no longer run (an agent killed while a
        worker started left one for good, naming a pid that may be reused); the files
        removed. Another agent's live workers keep theirs."""
        removed = []
        for path in self.run_dir.glob("*.ready.json"):
            record = read_ready_file(path)
            pid = record.get("pid") if record else None
            if isinstance(pid, int) and not psutil.pid_exists(pid):
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed.append(path)
        return removed

    # ---- queries ----------------------------------------------------------------------
    def list_workers(self, deployment_id: str = "") -> list[agent_pb.WorkerInfo]:
        return [
            _copy(w.info)
            for dep, procs in sorted(self._workers.items())
            if not deployment_id or dep == deployment_id
            for w in procs
        ]

    def worker_record(self, deployment_id: str, rank: int) -> dict | None:
        """What rank ``rank`` of the deployment last wrote into its ready record (a
        follower adds its peak memory as its steps run), or None."""
        for proc in self._workers.get(deployment_id, []):
            if proc.info.rank == rank and proc.host is None:
                return read_ready_file(proc.ready_file)
        return None

    def live_pids(self, device_id: str) -> list[int]:
        """Pids of the live workers (starting or ready) on ``device_id``."""
        return [
            w.popen.pid
            for procs in self._workers.values()
            for w in procs
            if w.plan.device.device_id == device_id and w.alive
        ]

    def deployments_on(self, device_id: str) -> list[str]:
        return sorted(
            dep
            for dep, procs in self._workers.items()
            if any(w.plan.device.device_id == device_id for w in procs)
        )

    # ---- start ------------------------------------------------------------------------
    async def start_workers(self, plan: LaunchPlan) -> list[agent_pb.WorkerInfo]:
        """Start the processes of ``plan`` (one per rank, or one for a TensorRT-LLM group:
        :attr:`LaunchPlan.processes`) and wait until all are ready; returns every rank's
        WorkerInfo.

        On any failure every worker of the plan is stopped before this raises:
        FailedPrecondition (a worker exited; its log tail says why), DeadlineExceeded (not
        ready within ``plan.ready_timeout_s``), Unavailable (a process could not start).
        """
        if plan.deployment_id in self._workers:
            raise AlreadyExists(
                f"deployment {plan.deployment_id!r} already has workers on node {self.node_id}; "
                "stop them first"
            )
        if plan.needs_rendezvous and not plan.rendezvous_address:
            # build_plan allows this only when every rank runs here: a loopback port, of
            # ISERVE_WORKER_PORTS where the operator set them (as the ranks' own).
            port = self._port_for(plan) or free_port()
            plan = replace(plan, rendezvous_address=f"127.0.0.1:{port}")
        procs: list[WorkerProcess] = []
        self._workers[plan.deployment_id] = procs  # claimed now, so stop_all sees them
        if plan.records_expire_s:
            self._records_expire_s[plan.deployment_id] = plan.records_expire_s
        try:
            for worker in plan.processes:
                # Beside the event loop: the first fork from the pool waits for it to have
                # imported torch (seconds from a cold disk), which held the agent's
                # heartbeat past its lifetime, and its node was taken for dead.
                spawning = asyncio.ensure_future(asyncio.to_thread(self._spawn, plan, worker))
                try:
                    procs.append(await asyncio.shield(spawning))
                except asyncio.CancelledError:
                    # The process starts all the same: stopped below with the others.
                    with contextlib.suppress(Exception):
                        procs.append(await spawning)
                    raise
                self._check_claimed(plan.deployment_id, procs)
            if len(plan.processes) < len(plan.workers):
                host = procs[0]  # one process runs the group: the others are its ranks
                procs[:] = [
                    host if worker in plan.processes else hosted_rank(host, worker)
                    for worker in plan.workers
                ]
            for proc in procs:
                await self._put_worker(proc.info)
            await self._wait_ready(plan, procs)
            self._check_claimed(plan.deployment_id, procs)
        except BaseException as exc:
            reason = str(exc) if isinstance(exc, Exception) else "start was cancelled"
            await self._abort_start(plan.deployment_id, procs, reason)
            raise
        log.info("deployment %s: %d worker(s) ready", plan.deployment_id, len(procs))
        return [_copy(p.info) for p in procs]

    def _spawn(self, plan: LaunchPlan, worker: WorkerPlan) -> WorkerProcess:
        stem = f"worker-{plan.deployment_id}-r{worker.rank}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{stem}.log"
        ready_file = self.run_dir / f"{stem}.ready.json"
        ready_file.unlink(missing_ok=True)
        argv = plan.worker_argv(worker, self.bind_host, ready_file, self._port_for(plan))
        argv += ["--drain-timeout-s", f"{self.drain_timeout_s:g}"]
        env = worker_environment(os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # so the log tail is current when a worker dies
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")])
        )
        if worker.device.cpu_cores and not worker.device.is_cuda:
            env["OMP_NUM_THREADS"] = str(len(worker.device.cpu_cores))
        try:
            keep_previous_log(log_path)
            if self.pool is not None:
                # Opened here first, as a fresh process's is: a worker whose log cannot
                # be opened fails in the fork, and its failure read the last run's log.
                log_path.open("wb").close()
                popen = self.pool.spawn(argv, env, log_path)
            else:
                with log_path.open("wb") as log_file:
                    popen = subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
        except OSError as exc:
            raise Unavailable(f"cannot start worker rank {worker.rank}: {exc}") from exc
        log.info(
            "deployment %s rank %d: started pid %d on %s (log %s)",
            plan.deployment_id, worker.rank, popen.pid, worker.device.device_id, log_path,
        )  # fmt: skip
        info = agent_pb.WorkerInfo(
            deployment_id=plan.deployment_id,
            rank=worker.rank,
            device_id=worker.device.device_id,
            pid=popen.pid,
            state=agent_pb.WORKER_STATE_STARTING,
        )
        return WorkerProcess(plan.deployment_id, worker, popen, log_path, ready_file, info)

    def _port_for(self, plan: LaunchPlan) -> int:
        """A port of ``worker_ports`` for a worker of ``plan`` (0: it picks its own)."""
        if self.worker_ports is None:
            return 0
        with self._ports_lock:
            try:
                port = free_port_in(self.worker_ports, self.bind_host, self._ports_handed)
            except OSError as exc:
                raise Unavailable(str(exc)) from exc
            self._ports_handed[port] = plan.deployment_id
            return port

    def _ports_back(self, deployment_id: str) -> None:
        """The ports handed to ``deployment_id``'s workers, free for others again."""
        with self._ports_lock:
            for port in [p for p, d in self._ports_handed.items() if d == deployment_id]:
                del self._ports_handed[port]

    def _check_claimed(self, deployment_id: str, procs: list[WorkerProcess]) -> None:
        """FailedPrecondition when the deployment's workers were stopped while they
        started (a Remove as it deployed): the ranks spawned after the stop, which it
        could not see, would otherwise run on untracked (they are stopped with the rest)."""
        if self._workers.get(deployment_id) is not procs:
            raise FailedPrecondition(
                f"the workers of deployment {deployment_id} were stopped while they started"
            )

    async def _wait_ready(self, plan: LaunchPlan, procs: list[WorkerProcess]) -> None:
        deadline = time.monotonic() + plan.ready_timeout_s
        pending = [p for p in procs if p.host is None]
        while pending:
            self._check_claimed(plan.deployment_id, procs)
            # Before reading the ready files: a worker that became ready after the
            # deadline (forked from the warm pool, a small model can be ready within one
            # poll) is late all the same.
            if time.monotonic() > deadline:
                tail = log_tail(pending[0].log_path)
                raise DeadlineExceeded(
                    f"worker(s) {[p.info.rank for p in pending]} of deployment "
                    f"{plan.deployment_id} not ready within {plan.ready_timeout_s:g} s; "
                    f"last log lines of rank {pending[0].info.rank}:\n{tail or '(empty log)'}"
                )
            for proc in list(pending):
                record = read_ready_file(proc.ready_file)
                if record is not None:
                    with contextlib.suppress(OSError):
                        proc.ready_log_bytes = proc.log_path.stat().st_size
                    proc.info.state = agent_pb.WORKER_STATE_READY
                    if int(record["port"]):  # ranks other than 0 serve nothing
                        proc.info.address = f"{self.advertise_host}:{int(record['port'])}"
                    proc.info.resident_bytes = int(record.get("resident_bytes", 0))
                    await self._put_worker(proc.info)
                    for hosted in (p for p in procs if p.host is proc):
                        hosted.info.state = agent_pb.WORKER_STATE_READY
                        await self._put_worker(hosted.info)
                    pending.remove(proc)
                    continue
                code = proc.popen.poll()
                if code is not None:
                    tail = log_tail(proc.log_path)
                    self._mark_failed(proc, code, tail)
                    killed = code in (-signal.SIGKILL, -signal.SIGTERM)
                    raise (WorkerKilled if killed else FailedPrecondition)(
                        f"worker rank {proc.info.rank} of deployment {plan.deployment_id} "
                        f"{describe_exit(code)} before it was ready:\n{tail or '(empty log)'}"
                    )
            if pending:
                await asyncio.sleep(_POLL_S)

    async def _abort_start(
        self, deployment_id: str, procs: list[WorkerProcess], reason: str
    ) -> None:
        """Stop every worker of a failed start and record them FAILED (no orphans)."""
        if self._workers.get(deployment_id) is procs:  # not a start of it made since
            del self._workers[deployment_id]
        await asyncio.gather(*(self._terminate(p) for p in procs))
        self._ports_back(deployment_id)
        for proc in procs:
            if proc.info.state != agent_pb.WORKER_STATE_FAILED:
                proc.info.state = agent_pb.WORKER_STATE_FAILED
                proc.info.exit_code = proc.popen.returncode or 0
                proc.info.reason = f"start of the deployment failed: {reason}"
            with contextlib.suppress(Exception):  # Redis trouble must not hide the cause
                await self._put_worker(proc.info)
        self._records_expire_s.pop(deployment_id, None)
        self._consequence_seen.pop(deployment_id, None)

    @staticmethod
    def _mark_failed(proc: WorkerProcess, code: int, tail: str) -> None:
        proc.info.state = agent_pb.WORKER_STATE_FAILED
        proc.info.exit_code = code
        proc.info.reason = f"{describe_exit(code)}: {tail}" if tail else describe_exit(code)

    # ---- stop -------------------------------------------------------------------------
    async def stop_workers(
        self, deployment_id: str, *, lost_rank: bool = False
    ) -> list[agent_pb.WorkerInfo]:
        """Stop every worker of ``deployment_id``: SIGTERM, rank 0 first, then SIGKILL for
        a worker still alive ``stop_timeout_s`` seconds (the drain plus a margin) after its
        SIGTERM; ``lost_rank`` (a rank of the group on another node is gone: nothing can
        drain) LOST_RANK_GRACE_S after it. Idempotent: an unknown deployment gives an
        empty list."""
        procs = self._workers.pop(deployment_id, [])
        await _exit_codes_readable(procs)
        # Ranks that died unasked before the reaper saw them are recorded as it would
        # (log, FAILED with the cause, the reply says it): a worker killed mid-stream is
        # reported by the scheduler first, and the stop that follows lost its exit code
        # and log tail. No worker_died event: the stop is the deployer's answer to it. A
        # rank that left because its group lost another is that loss's consequence, and
        # stopped like the rest.
        for proc, code in _exited(procs):
            if code != EXIT_GROUP_LOST:
                with contextlib.suppress(StateStoreUnavailable):
                    await self._report_death(deployment_id, procs, proc, code, publish=False)
        for proc in procs:
            proc.stopping = True
        grace = LOST_RANK_GRACE_S if lost_rank else None
        # Rank 0 drains first: every step of its generations needs the other ranks.
        await asyncio.gather(*(self._terminate(p, grace) for p in procs if p.info.rank == 0))
        await asyncio.gather(*(self._terminate(p, grace) for p in procs if p.info.rank != 0))
        # A death the reaper is recording as the stop came: its record (FAILED, the cause)
        # is written first, not overwritten STOPPED (a CI run lost a SIGKILL's cause so).
        while any(p.reporting_death for p in procs):
            await asyncio.sleep(_POLL_S)
        for proc in procs:
            if proc.info.state != agent_pb.WORKER_STATE_FAILED:
                proc.info.state = agent_pb.WORKER_STATE_STOPPED
                proc.info.exit_code = proc.popen.returncode or 0
            await self._put_worker(proc.info)
        self._records_expire_s.pop(deployment_id, None)
        self._consequence_seen.pop(deployment_id, None)
        self._ports_back(deployment_id)
        if procs:
            log.info("deployment %s: %d worker(s) stopped", deployment_id, len(procs))
            try:
                prune_stopped_logs(self.log_dir, self.run_dir, self._workers, KEPT_STOPPED_LOGS)
            except OSError as exc:  # the logs directory gone or unreadable: not the stop's
                log.warning("worker logs not pruned: %s", exc)
        return [p.info for p in procs]

    async def stop_all(self) -> None:
        """Stop every worker of this node (agent shutdown), the deployments side by side so
        that their drains overlap."""
        deployment_ids = list(self._workers)
        results = await asyncio.gather(
            *(self.stop_workers(d) for d in deployment_ids), return_exceptions=True
        )
        for deployment_id, result in zip(deployment_ids, results, strict=True):
            if isinstance(result, StateStoreUnavailable):
                # The workers are stopped before their records are written: only the
                # records are missing (the deployer reads the node's stop from its lapsed
                # heartbeat instead). No traceback for what is not an error of the agent's.
                log.warning(
                    "deployment %s: workers stopped, their records not written: %s",
                    deployment_id,
                    result,
                )
            elif isinstance(result, Exception):
                log.error("stopping deployment %s failed", deployment_id, exc_info=result)

    async def _terminate(self, proc: WorkerProcess, grace_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (default ``stop_timeout_s``)."""
        proc.stopping = True
        if proc.host is not None:
            return  # a hosted rank ends with its host's process, terminated on its own
        proc.ready_file.unlink(missing_ok=True)
        if not proc.alive:
            return
        self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + (self.stop_timeout_s if grace_s is None else grace_s)
        while proc.alive and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if proc.alive:
            log.warning("worker pid %d ignored SIGTERM; killing it", proc.popen.pid)
            self._signal(proc, signal.SIGKILL)
            while proc.alive:
                await asyncio.sleep(_POLL_S)

    @staticmethod
    def _signal(proc: WorkerProcess, sig: signal.Signals) -> None:
        # The worker leads its own session, so its process group id is its pid; a worker
        # forked from the pool an instant ago may not have left the server's session yet.
        try:
            os.killpg(proc.popen.pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.popen.pid, sig)
        except PermissionError:
            pass

    # ---- deaths -----------------------------------------------------------------------
    async def reap_forever(self) -> None:
        """Background task: report ready workers that exit without being asked."""
        failures = RetryLog(log, "reaping workers")
        while True:
            try:
                await self.reap_once()
            except StateStoreUnavailable as exc:
                failures.unavailable(exc)
            except Exception:  # noqa: BLE001 - Redis hiccups must not end the reaper
                failures.error()
            else:
                failures.succeeded()
            await asyncio.sleep(self.reap_interval_s)

    async def reap_once(self) -> list[agent_pb.WorkerInfo]:
        """Mark ready workers that have exited FAILED, in Redis with a ``worker_died`` event,
        and stop the other ranks of their deployments. The rank that died first is reported
        first: one that exited because its group lost a rank (``EXIT_GROUP_LOST``) comes
        after the rank it lost, which is given ``CAUSE_WAIT_S`` to be seen exiting too."""
        died = []
        for deployment_id, procs in list(self._workers.items()):
            exited = _exited(procs)
            if not exited or self._cause_may_follow(deployment_id, procs, exited):
                continue
            self._consequence_seen.pop(deployment_id, None)
            reported = []
            while exited:  # and those that exit as these are recorded
                exited.sort(key=lambda death: death[1] == EXIT_GROUP_LOST)
                for death in exited:
                    reported.append(await self._report_death(deployment_id, procs, *death))
                exited = _exited(procs)
            died += reported
            await self._stop_survivors(deployment_id, procs, reported[0].rank)
        if died:
            self.on_deaths(len(died))
        return died

    def _cause_may_follow(
        self, deployment_id: str, procs: list[WorkerProcess], exited: list[tuple]
    ) -> bool:
        """Whether every rank seen exited left because it lost another that still runs: a
        rank that exits of a dead peer can be reaped before the peer's own exit shows."""
        if not all(code == EXIT_GROUP_LOST for _, code in exited):
            return False
        gone = {id(proc) for proc, _ in exited}
        if not any(p.alive for p in _ready_ranks(procs) if id(p) not in gone):
            return False
        first_seen = self._consequence_seen.setdefault(deployment_id, time.monotonic())
        return time.monotonic() - first_seen < CAUSE_WAIT_S

    async def _report_death(
        self,
        deployment_id: str,
        procs: list[WorkerProcess],
        proc: WorkerProcess,
        code: int,
        *,
        publish: bool = True,
    ) -> agent_pb.WorkerInfo:
        """Record ``proc``'s exit (and its hosted ranks') FAILED, then (``publish``) publish
        it as a ``worker_died`` event."""
        proc.reporting_death = True
        try:
            return await self._record_death(deployment_id, procs, proc, code, publish)
        finally:
            proc.reporting_death = False

    async def _record_death(
        self,
        deployment_id: str,
        procs: list[WorkerProcess],
        proc: WorkerProcess,
        code: int,
        publish: bool,
    ) -> agent_pb.WorkerInfo:
        tail = log_tail(proc.log_path, since=proc.ready_log_bytes, routine=False)
        failed = _copy(proc.info)
        failed.state = agent_pb.WORKER_STATE_FAILED
        failed.exit_code = code
        failed.reason = f"{describe_exit(code)}: {tail}" if tail else describe_exit(code)
        hosted = [(p, _hosted_failed(p, failed)) for p in procs if p.host is proc]
        # Redis first: if it fails, the worker stays READY here and is retried.
        for _, info in hosted:
            await self._put_worker(info)
        await self._put_worker(failed)
        if publish and not self._disowned:
            await self.store.publish_event(
                "worker_died",
                node_id=self.node_id,
                deployment_id=deployment_id,
                rank=failed.rank,
                device_id=failed.device_id,
                pid=failed.pid,
                exit_code=code,
                reason=failed.reason,
            )
        proc.info.CopyFrom(failed)
        for hosted_proc, info in hosted:
            hosted_proc.info.CopyFrom(info)
        log.warning(
            "deployment %s rank %d (pid %d) died: %s",
            deployment_id, failed.rank, failed.pid, describe_exit(code),
        )  # fmt: skip
        return failed

    async def _stop_survivors(
        self, deployment_id: str, procs: list[WorkerProcess], dead_rank: int
    ) -> None:
        """Stop the ranks of ``deployment_id`` still alive after rank ``dead_rank`` died
        (a parallel group cannot serve without it) and record them FAILED, as those that
        exited of its loss since the reaper looked (one that had would stay READY)."""
        survivors = _ready_ranks(procs)
        if not survivors:
            return
        for proc in survivors:
            proc.stopping = True
        await asyncio.gather(*(self._terminate(p) for p in survivors))
        for proc in survivors:
            proc.info.state = agent_pb.WORKER_STATE_FAILED
            proc.info.exit_code = proc.popen.returncode or 0
            proc.info.reason = f"stopped because rank {dead_rank} of the deployment died"
            await self._put_worker(proc.info)
        log.warning(
            "deployment %s: stopped rank(s) %s after rank %d died",
            deployment_id, [p.info.rank for p in survivors], dead_rank,
        )  # fmt: skip


def _ready_ranks(procs: list[WorkerProcess]) -> list[WorkerProcess]:
    """The ranks of ``procs`` with a process of their own that were ready and that the
    agent has not asked to stop (exited since or not)."""
    return [
        p
        for p in procs
        if not p.stopping and p.host is None and p.info.state == agent_pb.WORKER_STATE_READY
    ]


async def _exit_codes_readable(procs: list[WorkerProcess]) -> None:
    """Wait, up to ``REAPED_CODE_WAIT_S``, until every ready rank of ``procs`` that the
    process table shows exited has an exit code to read (:func:`process_running`): a
    stop that came in between took a killed worker for running, and recorded it STOPPED,
    its cause lost (a loaded CI run)."""
    deadline = time.monotonic() + REAPED_CODE_WAIT_S
    while time.monotonic() < deadline and any(
        p.popen.poll() is None and not process_running(p.popen.pid) for p in _ready_ranks(procs)
    ):
        await asyncio.sleep(_POLL_S / 5)


def _exited(procs: list[WorkerProcess]) -> list[tuple[WorkerProcess, int]]:
    """The ready ranks of ``procs`` whose processes exited unasked, with their codes."""
    return [
        (p, code)
        for p in _ready_ranks(procs)
        if not p.reporting_death and (code := p.popen.poll()) is not None
    ]


def hosted_rank(host: WorkerProcess, worker: WorkerPlan) -> WorkerProcess:
    """``worker``'s record as a rank that ``host``'s process runs: the host's pid, log and
    ready file, no address of its own (only rank 0 serves)."""
    info = agent_pb.WorkerInfo(
        deployment_id=host.deployment_id,
        rank=worker.rank,
        device_id=worker.device.device_id,
        pid=host.info.pid,
        state=host.info.state,
    )
    return WorkerProcess(
        host.deployment_id, worker, host.popen, host.log_path, host.ready_file, info, host=host
    )


def _hosted_failed(hosted: WorkerProcess, host_failed: agent_pb.WorkerInfo) -> agent_pb.WorkerInfo:
    """``hosted``'s record once its host's process died (``host_failed``)."""
    failed = _copy(hosted.info)
    failed.state = agent_pb.WORKER_STATE_FAILED
    failed.exit_code = host_failed.exit_code
    failed.reason = f"rank {host_failed.rank}'s process, which ran this rank, {host_failed.reason}"
    return failed
