"""``iserve up`` / ``iserve down``: the whole stack on this machine as child processes.

``up`` starts an embedded redis-server (unless ``REDIS_URL`` is set), the model,
estimator, deployment and scheduler services and one node agent, waits until every one
answers its gRPC health check, then the OpenAI-compatible HTTP gateway (until its
``/health`` answers), and writes ``$ISERVE_STATE_DIR/stack.json`` with the
addresses and pids so that other ``iserve`` commands (and ``down``) find them. Logs go to
``$ISERVE_STATE_DIR/logs/<service>.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import redis

from services import replicas, transport
from services.api import deployment_service_pb2 as deploy_pb
from services.api import deployment_service_pb2_grpc
from services.cli import deploying
from services.cli.interrupts import Interrupts, interrupt_on
from services.exits import describe_exit
from services.files import write_private
from services.health import check, wait_http, wait_serving
from services.ports import bindable, ephemeral_range, free_port, reserve
from services.redis_embedded import start_redis
from services.settings import (
    ADMIN_TOKEN_ENV,
    AUTH_ENV,
    GATEWAY_ENV,
    GIB,
    METRICS_ENV,
    SERVICE_ENV,
    SERVICE_TOKEN_ENV,
    STACK_FILE,
    STACK_ID_ENV,
    WITHHELD_FROM_GATEWAY,
    Settings,
    load_settings,
    read_stack_file,
    redacted_url,
    stack_token,
    token_file,
    write_stack_file,
)
from services.state.store import StateStore, StateStoreRefused, StateStoreUnavailable

# Start order; ``down`` stops them in reverse (agent last, so it can stop its workers).
SERVICES = [
    ("agent", "monitor_agent"),
    ("model", "fingerprint_svc"),
    ("estimator", "estimator_svc"),
    ("deploy", "deploy_svc"),
    ("scheduler", "scheduler_svc"),
]
# The OpenAI-compatible HTTP gateway starts last (it calls the others) and stops first.
GATEWAY, GATEWAY_MODULE = "gateway", "gateway_svc"
READY_TIMEOUT_S = 60.0
# What stops `iserve up` while it starts, and a foreground `up` once started: Ctrl-C, a
# service manager's stop, the terminal's close.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long `up` waits for the operator's Redis (REDIS_URL) to answer before it starts
# anything: it is meant to be running already.
UP_REDIS_WAIT_S = 3.0
# The embedded Redis listens here only: the stack's processes on this machine reach it.
REDIS_HOST = "127.0.0.1"
# How long ``up`` waits for the deployments kept from before to be served again.
RESTORE_TIMEOUT_S = 300.0
# How long a service gets to exit after SIGTERM before SIGKILL, on top of its drain
# (``Settings.drain_timeout_s``: the scheduler lets streams in flight finish first).
STOP_TIMEOUT_S = 20.0
# How long ``down`` lets a stopped service's helpers exit on their own before it takes
# those still carrying the stack's id for unrecorded processes.
STRAY_GRACE_S = 3.0


@dataclass(frozen=True)
class UpOptions:
    devices: int | None = None
    device_memory_gib: float | None = None


def port_in_use(address: str) -> bool:
    """Whether something holds ``address`` ("host:port"), tested by binding it as a server
    would (``services.ports.bindable``). Not by connecting: the default ports lie in the
    kernel's ephemeral range, and a connect to an unused one can pick that same port as its
    source and connect to itself, which both reports the port busy and keeps it from the
    service for a minute."""
    host, _, port = address.rpartition(":")
    return not bindable(host or "127.0.0.1", int(port))


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None
    without procfs or such a process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _started(fields: list[str] | None) -> int | None:
    """The start time in ``/proc/<pid>/stat`` fields (:func:`_stat`): field 22."""
    return int(fields[19]) if fields and len(fields) > 19 else None


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot: with the pid, what names one
    process, since the system reuses pids. None without procfs."""
    return _started(_stat(pid))


def _alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs and is the process that started at ``started`` (when known:
    after a crash or a reboot the pid may belong to another process now). A zombie
    (exited, its parent not yet told, as the children of a foreground ``iserve up`` while
    another process runs ``iserve down``) does not run."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return started is None  # someone else's process: not ours if we know ours
    fields = _stat(pid)
    if fields is None:
        return True  # no procfs: signal 0 is all there is
    if started is not None and _started(fields) not in (started, None):
        return False
    return fields[0] != "Z"


def _record(stack: dict, name: str, pid: int) -> None:
    """Note ``pid`` as the stack's ``name`` process in ``stack`` and in stack.json at once,
    with its start time: a stack whose ``iserve up`` was killed while it started is
    still one `iserve down` stops (its processes ran on, recorded nowhere)."""
    stack["pids"][name] = pid
    stack.setdefault("started", {})[name] = start_time(pid)
    write_stack_file(Path(stack["state_dir"]), stack)


def _ours(stack: Mapping) -> dict[str, tuple[int, int | None]]:
    """Each recorded process of ``stack``: (pid, start time, or None when it cannot be
    told). A record written before start times were (an older iserve) names its process
    by pid alone, which the system may have given another since (a crash, a reboot):
    such a pid counts as the stack's only while its command line is that process's
    (:func:`_pid_start_if_ours`), and an upgraded ``iserve down`` stopped an unrelated
    process whose pid had been reused otherwise (a tester)."""
    started = stack.get("started", {})
    return {
        name: (
            pid,
            started[name] if started.get(name) is not None else _pid_start_if_ours(name, pid),
        )
        for name, pid in stack.get("pids", {}).items()
    }


# What each of the stack's processes runs, as its command line shows it.
_COMMANDS = {**dict(SERVICES), GATEWAY: GATEWAY_MODULE, "redis": "redis-server"}
# A start time no process has: the pid's process is not the one recorded.
_NOT_OURS = -1


def _pid_start_if_ours(name: str, pid: int) -> int | None:
    """``pid``'s start time when its command line runs the stack's ``name`` process,
    ``_NOT_OURS`` when it runs something else, None without procfs or such a process
    (nothing to tell it by)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    command = _COMMANDS.get(name, name).encode()
    # Each argument's first word, its directory left out: redis-server writes its title
    # ("redis-server 127.0.0.1:6379") over its arguments.
    words = {arg.split(b" ", 1)[0].rsplit(b"/", 1)[-1] for arg in argv}
    if command not in words:
        return _NOT_OURS
    return start_time(pid)


# What to do about a stack running without one of its processes.
RESTART_ADVICE = (
    "`iserve down`, then `iserve up` starts it all again, and restores the deployments "
    "without spending their restart budget"
)


def exited_processes(state_dir: Path, stack: Mapping) -> dict[str, Path]:
    """The processes recorded in ``stack`` (read from ``state_dir``) that no longer run,
    each with its log, in name order."""
    return {
        name: log_of(state_dir, name)
        for name, started in sorted(_ours(stack).items())
        if not _alive(*started)
    }


def stack_running(settings: Settings) -> dict:
    """The recorded stack if any of its processes is still alive, else ``{}``."""
    stack = read_stack_file(settings.state_dir)
    return stack if any(_alive(*p) for p in _ours(stack).values()) else {}


@contextlib.contextmanager
def _starting(state_dir: Path) -> Iterator[None]:
    """Held while ``iserve up`` starts a stack in ``state_dir``: a second ``up`` at the
    same time is refused, instead of starting a second Redis on the same data."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        lock = open(state_dir / "up.lock", "a")  # noqa: SIM115 - held below
    except OSError as exc:
        # A read-only or full disk said only "[Errno 30] Read-only file system".
        raise RuntimeError(
            f"cannot prepare the stack's state directory {state_dir}: {exc.strerror or exc}; "
            "set ISERVE_STATE_DIR to a writable directory of this user's with free space"
        ) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another `iserve up` is starting the stack from {state_dir}; wait for it "
                "(`iserve status`)"
            ) from None
        yield


def with_chosen_ports(settings: Settings) -> Settings:
    """``settings`` with each ``host:0`` address (any free port) naming a free port chosen
    now, so that every process, stack.json and ``iserve status`` say the same port. The
    ports the settings name are reserved first: their servers start later, so nothing is
    bound there yet, and neither a chosen port nor the embedded Redis's may be one of them."""
    named = [
        *settings.addresses.values(),
        *settings.metrics_addresses.values(),
        settings.gateway_address,
    ]
    reserve(int(port) for _, _, port in (a.rpartition(":") for a in named) if port.isdigit())

    def chosen(address: str) -> str:
        host, _, port = address.rpartition(":")
        return f"{host}:{free_port(host or '127.0.0.1')}" if port == "0" else address

    return replace(
        settings,
        addresses={name: chosen(a) for name, a in settings.addresses.items()},
        metrics_addresses={name: chosen(a) for name, a in settings.metrics_addresses.items()},
        gateway_address=chosen(settings.gateway_address),
    )


def up(
    settings: Settings, options: UpOptions, log=print, *, hold_stop_signals: bool = False
) -> dict:
    """Start the stack; returns what was written to stack.json. Raises RuntimeError.

    SIGTERM and SIGHUP while it starts unwind it as Ctrl-C does, stopping what started
    (a service manager's stop, `timeout` or a closed terminal left the whole stack
    running, unrecorded); and stack.json names each process as it starts, so that
    `iserve down` stops them even after a SIGKILL. A signal ignored when `up` began
    (``nohup``) stays ignored. ``hold_stop_signals``: once started, STOP_SIGNALS are left
    blocked for the caller's ``signal.sigtimedwait`` (none is lost between the two)."""
    started = None
    try:
        with _starting(settings.state_dir), contextlib.ExitStack() as cleanup:
            interrupts = interrupt_on(STOP_SIGNALS, cleanup)
            if hold_stop_signals:
                # Run before the handlers are put back (the callbacks run last in, first out).
                cleanup.push(_hold_on_success)
            started = _up(settings, options, log, interrupts)
    except OSError as exc:  # what it started is stopped: a file it could not write, say
        raise RuntimeError(f"the stack did not start: {exc}{_state_dir_hint(exc)}") from None
    except KeyboardInterrupt:
        if started is not None:  # a stop signal held as the start ended: it stops it all
            down(settings, lambda _msg: None)
        raise
    return started


def _state_dir_hint(exc: OSError) -> str:
    """What to do about an OSError of a file under the state directory, where it is one
    of a full or refusing disk."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "; free space on that disk, or set ISERVE_STATE_DIR to a directory on one with room"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "; set ISERVE_STATE_DIR to a writable directory of this user's"
    return ""


def _hold_on_success(exc_type, _exc, _tb) -> bool:
    """Block the stop signals this process heeds when the start succeeded (an ExitStack
    exit callback)."""
    if exc_type is None:
        signal.pthread_sigmask(signal.SIG_BLOCK, heeded_stop_signals())
    return False


def _check_auth_kept(settings: Settings) -> None:
    """Refuse to start open, with ISERVE_AUTH merely unset, a stack meant to check tokens:
    one whose state directory holds a token an earlier `up` with ISERVE_AUTH=on wrote
    (``tokens/admin``, or ``tokens/service`` alone where the environment gave the admin
    token), or one given ISERVE_ADMIN_TOKEN or ISERVE_SERVICE_TOKEN now. Started open, its
    models, deployments and token records would be served to anyone who reaches its
    ports, for want of one variable in a new shell (a probe found it started open,
    saying so only in its logs). ISERVE_AUTH=off starts it open on purpose."""
    if settings.auth or os.environ.get(AUTH_ENV, "").strip():
        return
    written = (token_file(settings.state_dir, name) for name in ("admin", "service"))
    kept = next((path for path in written if path.exists()), None)
    given = [v for v in (ADMIN_TOKEN_ENV, SERVICE_TOKEN_ENV) if os.environ.get(v, "").strip()]
    if kept is not None:
        why = f"the stack of {settings.state_dir} was started with {AUTH_ENV}=on (it holds {kept})"
    elif given:
        why = f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set"
    else:
        return
    raise RuntimeError(
        f"{why}, and {AUTH_ENV} is not set now: started so, it would take calls from "
        f"anyone who reaches its ports. Set {AUTH_ENV}=on to check tokens, or "
        f"{AUTH_ENV}=off to start it open on purpose"
    )


def heeded_stop_signals() -> tuple[signal.Signals, ...]:
    """STOP_SIGNALS less those this process ignores (``nohup``'s SIGHUP): a blocked signal
    is queued even when ignored, and sigtimedwait took nohup's SIGHUP as a stop (a probe)."""
    return tuple(s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN)


def _up(settings: Settings, options: UpOptions, log, interrupts: Interrupts) -> dict:
    began = time.time()
    settings = with_chosen_ports(settings)
    running = stack_running(settings)
    if running:
        dead = exited_processes(settings.state_dir, running)
        if dead:
            # Either way no budget is spent: a clean stop is recorded as such, and the
            # new agent, with no record of the old workers, has them lost with their
            # node (a probe: the message said Redis's exit would spend it; it did not).
            raise RuntimeError(
                f"the stack from {settings.state_dir} is running without its "
                f"{', '.join(dead)} (exited; see {', '.join(map(str, dead.values()))}): "
                f"{RESTART_ADVICE}"
            )
        raise RuntimeError(
            f"a stack is already running from {settings.state_dir} (see `iserve status`, or `iserve down`)"
        )
    recorded = read_stack_file(settings.state_dir)
    if recorded.get("embedded_redis") and settings.redis_url == recorded.get("redis_url"):
        # The Redis a stack that is no longer running embedded (it was killed, or the
        # machine restarted without `iserve down`): gone with it, so started again on
        # its data, not taken for a Redis of the operator's.
        settings = replace(settings, redis_url=None)
    _check_distinct_addresses(settings)
    _check_auth_kept(settings)
    busy = [
        f"{name} {addr}"
        for name, addr in [
            *settings.addresses.items(),
            *((f"{n} metrics", a) for n, a in settings.metrics_addresses.items()),
        ]
        if not addr.endswith(":0") and port_in_use(addr)
    ]
    if port_in_use(settings.gateway_address):
        busy.append(f"gateway {settings.gateway_address}")
    redis_address = f"{REDIS_HOST}:{settings.redis_port}"
    if not settings.redis_url and settings.redis_port and port_in_use(redis_address):
        busy.append(f"embedded Redis (ISERVE_REDIS_PORT) {redis_address}")
    if busy:
        hint = ""
        ephemeral = ephemeral_range()
        ports = [int(entry.rpartition(":")[2]) for entry in busy]
        if ephemeral is not None and any(port in ephemeral for port in ports):
            # 50061-50065 lie in Linux's usual 32768-60999: a connection of any program
            # may have drawn one as its own source port, until it closes.
            hint = (
                f" (a port in the kernel's range for outgoing connections, "
                f"{ephemeral.start}-{ephemeral.stop - 1}, may be held by another program's "
                "connection until it closes: retrying in a minute may find it free)"
            )
        raise RuntimeError(
            f"port(s) already in use: {', '.join(busy)}; set ISERVE_*_ADDR or stop what "
            f"uses them{hint}"
        )
    logs = settings.state_dir / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        logs.chmod(0o700)  # the services' logs are the operator's to read, no one else's
        settings.models_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(
            f"cannot prepare the stack's directories under {settings.state_dir} (logs, "
            f"models root {settings.models_root}): {exc}; set ISERVE_STATE_DIR to a "
            "directory of this user's"
        ) from None
    stack: dict = {
        "state_dir": str(settings.state_dir),
        # In every service's environment (STACK_ID_ENV), recorded before any starts: a
        # service started but not yet recorded when `iserve up` was killed is found by it.
        "stack_id": uuid.uuid4().hex,
        "pids": {},
        "addresses": {},
        "metrics_addresses": dict(settings.metrics_addresses),
    }
    redis_proc = None
    procs: dict[str, subprocess.Popen] = {}
    try:
        # The stack id on disk before anything starts: with an operator's Redis the first
        # record came only after the agent's spawn, and a kill between the two left it
        # running where `iserve down` found no stack (a probe).
        write_stack_file(settings.state_dir, stack)
        if settings.redis_url:
            redis_url = settings.redis_url
            _check_reachable(redis_url)
            log(f"using Redis at {redacted_url(redis_url)}")
        else:
            stack["embedded_redis"] = True
            redis_proc, redis_url = start_redis(
                _redis_dir(settings.state_dir),
                settings.redis_port or None,
                host=REDIS_HOST,
                started=lambda pid: _record(stack, "redis", pid),
            )
            _STARTED.append(redis_proc)
            stack["redis_url"] = redis_url
            write_stack_file(settings.state_dir, stack)
            log(f"started embedded redis-server at {redacted_url(redis_url)}")
        stack["redis_url"] = redis_url
        if settings.auth:
            for path in write_stack_tokens(settings):
                log(f"authentication on: wrote {path}")
            if settings.admin_token and not token_file(settings.state_dir, "admin").exists():
                # Given in the environment, it is in no file the CLI would read.
                log(
                    f"authentication on: the admin token is {ADMIN_TOKEN_ENV}'s; give it "
                    "to the CLI as ISERVE_TOKEN"
                )
            else:
                log(f"authentication on: the CLI uses {token_file(settings.state_dir, 'admin')}")
        # Read before the deployer starts restoring them: listed later, one that failed
        # or came back already went unmentioned (a deployment whose checkpoint is gone
        # fails within a second).
        kept = _kept_deployments(redis_url)
        env = _service_env(settings, redis_url, options, stack["stack_id"])
        for name, module in SERVICES:
            procs[name] = _spawn(module, env, logs / f"{name}.log")
            _record(stack, name, procs[name].pid)
            stack["addresses"][name] = settings.address(name)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name, _ in SERVICES:
            if not wait_serving(settings.address(name), deadline, procs[name]):
                tail = _tail(logs / f"{name}.log")
                raise RuntimeError(f"{name} did not become ready; last log lines:\n{tail}")
            log(
                f"{name:<10} ready on {settings.address(name)} "
                f"(metrics {settings.metrics_url(name)})"
            )
        gateway_env = {k: v for k, v in env.items() if k not in WITHHELD_FROM_GATEWAY}
        procs[GATEWAY] = _spawn(GATEWAY_MODULE, gateway_env, logs / f"{GATEWAY}.log")
        _record(stack, GATEWAY, procs[GATEWAY].pid)
        stack["gateway_address"] = settings.gateway_address
        if not wait_http(f"http://{settings.gateway_address}/health", deadline, procs[GATEWAY]):
            tail = _tail(logs / f"{GATEWAY}.log")
            raise RuntimeError(f"the gateway did not become ready; last log lines:\n{tail}")
        log(
            f"{GATEWAY:<10} ready on http://{settings.gateway_address}/v1 "
            f"(OpenAI-compatible; metrics http://{settings.gateway_address}/metrics)"
        )
        interrupts.check()
    except BaseException as exc:
        interrupts.hold()  # a second stop signal does not cut this stop short
        started = (
            {n: (p.pid, None) for n, p in procs.items()}
            | ({"redis": (redis_proc.pid, None)} if redis_proc else {})
            | _ours(stack)
        )
        _stop_pids(started)
        # And what started unrecorded: a stop while the embedded Redis started (before
        # start_redis returned) left it running, and `iserve down` found no stack (a probe).
        _stop_strays(settings, stack, {pid for pid, _ in started.values()})
        # The record this start wrote, of what it stopped.
        (settings.state_dir / STACK_FILE).unlink(missing_ok=True)
        stopper = _stopped_by_down(settings.state_dir, began)
        if stopper is not None and isinstance(exc, Exception):
            # What it stopped first reads as a service that "did not become ready", its
            # log ending "SIGTERM received" (a tester).
            raise RuntimeError(
                f"the stack was stopped by `iserve down` (pid {stopper}) while it started"
            ) from None
        raise
    stack["started_at_unix_ms"] = int(time.time() * 1000)
    stack["models_root"] = str(settings.models_root)  # where the stack reads checkpoints
    write_stack_file(settings.state_dir, stack)
    try:
        wait_for_restored(settings, log, kept=kept)
        interrupts.check()
    except KeyboardInterrupt:
        # Stopped while it waited for the deployments kept from before: still starting.
        interrupts.hold()
        down(settings, lambda _msg: None)
        raise
    return stack


def _check_distinct_addresses(settings: Settings) -> None:
    """RuntimeError naming the settings when two of the stack's servers are given one
    port on one host (or one of them on every interface). gRPC binds with port reuse:
    two services on one port both started, `up` said the stack was up, and calls went to
    either at random ("UNIMPLEMENTED: Method not found!", a probe)."""
    named = [
        *((f"{name} ({SERVICE_ENV[name]})", addr) for name, addr in settings.addresses.items()),
        *(
            (f"{name} metrics ({METRICS_ENV[name]})", addr)
            for name, addr in settings.metrics_addresses.items()
        ),
        (f"gateway ({GATEWAY_ENV})", settings.gateway_address),
    ]
    if not settings.redis_url and settings.redis_port:
        named.append(("embedded Redis (ISERVE_REDIS_PORT)", f"{REDIS_HOST}:{settings.redis_port}"))
    seen: list[tuple[str, str, str]] = []
    for label, address in named:
        host, _, port = address.rpartition(":")
        if port in ("", "0"):
            continue  # any free port
        host = host.strip("[]")
        for other_label, other_host, other_port in seen:
            if port == other_port and (
                host == other_host or {host, other_host} & {"", "0.0.0.0", "::"}
            ):
                raise RuntimeError(
                    f"{label} and {other_label} are both given port {port}: give each "
                    "server a port of its own"
                )
        seen.append((label, host, port))


def _check_reachable(redis_url: str) -> None:
    """RuntimeError naming ``REDIS_URL`` when the operator's Redis does not answer within
    UP_REDIS_WAIT_S, or refuses (credentials, a database it lacks). Before, every service
    waited for it in turn and `up` blamed the first ("agent did not become ready") after
    some 13 s, the cause in that service's log lines."""

    async def ping() -> None:
        store = StateStore.from_url(redis_url)
        try:
            await store.wait_until_answering(UP_REDIS_WAIT_S)
        finally:
            await store.close()

    try:
        asyncio.run(ping())
    except StateStoreRefused as exc:
        raise RuntimeError(f"Redis at {redacted_url(redis_url)} (REDIS_URL): {exc}") from None
    except (StateStoreUnavailable, redis.RedisError, OSError, ValueError) as exc:
        raise RuntimeError(
            f"cannot reach Redis at {redacted_url(redis_url)} (REDIS_URL): "
            f"{str(exc).rstrip('.')}; start it (or fix the URL), or unset REDIS_URL and "
            "`iserve up` starts an embedded one"
        ) from None


def _kept_deployments(redis_url: str) -> list[str] | None:
    """The deployments Redis holds as serving or starting (the deployer restores them
    when it starts); None when Redis cannot tell (then they are listed later)."""
    live = (deploy_pb.DEPLOYMENT_STATE_READY, deploy_pb.DEPLOYMENT_STATE_STARTING)

    async def read() -> list[str]:
        store = StateStore.from_url(redis_url)
        try:
            return sorted(
                d.deployment_id for d in await store.list_deployments() if d.state in live
            )
        finally:
            await store.close()

    try:
        return asyncio.run(read())
    except (StateStoreUnavailable, redis.RedisError, ValueError):
        return None


def _serving(deployment: deploy_pb.Deployment) -> bool:
    """READY, and the worker of every replica not taken out answers: a record from
    before a stop names workers that are gone until the deployer has restarted them. A
    replica the deployer gave up on (FAILED), or one waiting for a node that is gone
    (another host's agent, which may be down for hours), is not waited for: `iserve up`
    waited its whole 300 s for one while the deployment served on its other replica."""
    kept = [
        r
        for r in replicas.replicas_of(deployment)
        if r.state != replicas.FAILED and not replicas.waits_for_a_node(r)
    ]
    return (
        deployment.state == deploy_pb.DEPLOYMENT_STATE_READY
        and bool(kept)
        and all(
            r.state == replicas.READY and r.worker_address and check(r.worker_address, 0.5)
            for r in kept
        )
    )


def _replicas_out(deployment: deploy_pb.Deployment) -> str:
    """ " (replica N out: reason; …)" for the replicas the deployer gave up on or that
    wait for a node that is gone, else ""."""
    out = [
        f"replica {r.index} out: {replicas.reason_summary(r.state_reason)}"
        for r in deployment.replicas
        if r.state == replicas.FAILED or replicas.waits_for_a_node(r)
    ]
    return f" ({'; '.join(out)})" if out else ""


def wait_for_restored(
    settings: Settings,
    log=print,
    timeout_s: float = RESTORE_TIMEOUT_S,
    kept: list[str] | None = None,
) -> list[str]:
    """Wait until the deployments Redis kept from before are served again (the deployer
    restarts their workers); returns the ids of those that are not, after saying why.
    Until then, requests for them would get 503s. ``kept``: their ids as read before the
    deployer started (None: those listed now that do not serve yet)."""
    # The stack's own admin token: the CLI's settings were read before `up` wrote it.
    token = settings.admin_token or stack_token(settings.state_dir, "admin")
    channel = transport.current().sync_channel(
        settings.address("deploy"), token=token if settings.auth else None
    )
    stub = deployment_service_pb2_grpc.DeploymentServiceStub(channel)
    live = (deploy_pb.DEPLOYMENT_STATE_READY, deploy_pb.DEPLOYMENT_STATE_STARTING)

    def listed() -> dict[str, deploy_pb.Deployment]:
        reply = stub.ListDeployments(deploy_pb.ListDeploymentsRequest(), timeout=10)
        return {d.deployment_id: d for d in reply.deployments}

    try:
        waiting = (
            sorted(kept)
            if kept is not None
            else sorted(i for i, d in listed().items() if d.state in live and not _serving(d))
        )
    except grpc.RpcError as exc:
        # The stack is up; only the wait is skipped.
        log(f"could not list the deployments kept from before ({exc.code().name}: {exc.details()})")
        return []
    if not waiting:
        return []
    started = time.monotonic()
    log(f"restoring {len(waiting)} deployment(s) kept in Redis: {', '.join(waiting)}")
    failed = []
    while waiting and time.monotonic() - started < timeout_s:
        time.sleep(0.25)
        now = listed()
        for deployment_id in list(waiting):
            deployment = now.get(deployment_id)
            serving = deployment is not None and _serving(deployment)
            if deployment is not None and deployment.state in live and not serving:
                continue
            waiting.remove(deployment_id)
            if serving:
                log(
                    f"deployment {deployment_id} restored ({time.monotonic() - started:.1f} s)"
                    + _replicas_out(deployment)
                )
                continue
            failed.append(deployment_id)
            if deployment is None:
                state = "removed"
            else:
                reason = replicas.reason_summary(deployment.state_reason)
                why = f": {reason}" if reason else ""
                state = deploying.state_name(deployment.state) + why
            log(f"deployment {deployment_id} was not restored ({state})")
    if waiting:
        log(
            f"not restored within {timeout_s:.0f} s: {', '.join(waiting)} "
            f"(`iserve status` shows their state)"
        )
    return failed + waiting


def write_stack_tokens(settings: Settings) -> list[Path]:
    """Create the stack's admin and service tokens (mode 0600) where the environment
    gives none and no file holds one; returns the files written. A token file that
    others may read (placed there by hand, say) is made the owner's alone, as written."""
    written = []
    for name, given in (("admin", settings.admin_token), ("service", settings.service_token)):
        path = token_file(settings.state_dir, name)
        if path.exists() and path.stat().st_mode & 0o077:
            path.chmod(0o600)
        if given or path.exists():
            continue
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(path, secrets.token_urlsafe(32) + "\n", exclusive=True)
        written.append(path)
    return written


def _service_env(
    settings: Settings, redis_url: str, options: UpOptions, stack_id: str
) -> dict[str, str]:
    """The environment every service of the stack runs with."""
    env = dict(os.environ)
    env.update(
        {
            STACK_ID_ENV: stack_id,
            "REDIS_URL": redis_url,
            "ISERVE_STATE_DIR": str(settings.state_dir),
            "ISERVE_MODELS_ROOT": str(settings.models_root),
            "PYTHONUNBUFFERED": "1",
            # Paths come over gRPC as Unicode; under a locale that does not decode file
            # names as UTF-8 (LC_ALL=C with PYTHONUTF8=0) the agent could not name a
            # checkpoint under "modèles/", and its deployments spent their restart budget
            # on the UnicodeEncodeError (a tester). UTF-8 mode reads names as UTF-8.
            "PYTHONUTF8": "1",
        }
    )
    for name, var in SERVICE_ENV.items():
        env[var] = settings.address(name)
    for name, var in METRICS_ENV.items():
        env[var] = settings.metrics_address(name)
    env[GATEWAY_ENV] = settings.gateway_address
    env.update(flag_variables(options))
    return env


def flag_variables(options: UpOptions) -> dict[str, str]:
    """The variables `iserve up`'s flags given stand for (``--devices``:
    ISERVE_DEVICES, ``--device-memory``: ISERVE_DEVICE_MEMORY_GIB)."""
    env = {}
    if options.devices is not None:
        env["ISERVE_DEVICES"] = str(options.devices)
    if options.device_memory_gib is not None:
        env["ISERVE_DEVICE_MEMORY_GIB"] = str(options.device_memory_gib)
    return env


# Written to a log before each start of its process: a failure's tail shows this start's
# lines only (the logs are appended to across runs), and a reader sees where runs begin.
START_MARK = "==== iserve: starting "


# The stack's processes this process started, each kept for as long as it runs: a Popen
# collected reaps its child if it exited, and a service that died before `up` returned
# went unmentioned by the foreground `up`'s warnings (reap_children found no status).
_STARTED: list[subprocess.Popen] = []


def _spawn(module: str, env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        out.write(f"{START_MARK}python -m {module} at {when} ====\n".encode())
        out.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _STARTED.append(proc)
    return proc


def restart_service(settings: Settings, name: str, *, kill: bool = False) -> int:
    """Stop one service of the running stack (SIGKILL with ``kill``, as a crash would;
    else SIGTERM), start it again with the stack's environment, wait until it answers
    and record its new pid; returns the pid. RuntimeError when it does not come back."""
    stack = read_stack_file(settings.state_dir)
    modules = dict(SERVICES)
    if not stack or name not in modules:
        raise RuntimeError(f"no running stack with a {name!r} service in {settings.state_dir}")
    pid, started = _ours(stack)[name]
    if kill and _alive(pid, started):
        os.kill(pid, signal.SIGKILL)
        while _alive(pid, started):
            _reap(pid)
            time.sleep(0.02)
    else:
        _stop_pids({name: (pid, started)}, timeout_s=STOP_TIMEOUT_S + settings.drain_timeout_s)
    log_path = settings.state_dir / "logs" / f"{name}.log"
    env = _service_env(settings, stack["redis_url"], UpOptions(), stack.get("stack_id", ""))
    proc = _spawn(modules[name], env, log_path)
    if not wait_serving(settings.address(name), time.monotonic() + READY_TIMEOUT_S, proc):
        raise RuntimeError(f"{name} did not come back; last log lines:\n{_tail(log_path)}")
    _record(stack, name, proc.pid)
    write_stack_file(settings.state_dir, stack)
    return proc.pid


# Written by `iserve down` as it stops a stack (its pid): an `up` it stopped midway tells
# a stop from a service that failed.
DOWN_FILE = "down.pid"


def _stopped_by_down(state_dir: Path, since: float) -> int | None:
    """The pid of an `iserve down` that began stopping the stack in ``state_dir`` at or
    after ``since`` (a ``time.time()``), if one did."""
    path = state_dir / DOWN_FILE
    try:
        if path.stat().st_mtime < since:
            return None
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def down(settings: Settings, log=print) -> bool:
    """Stop the recorded stack; False when there was none."""
    stack = read_stack_file(settings.state_dir)
    if not stack:
        return False
    with contextlib.suppress(OSError):  # only a message depends on it
        write_private(settings.state_dir / DOWN_FILE, f"{os.getpid()}\n")
    _down(settings, stack, log)
    return True


def _down(settings: Settings, stack: dict, log) -> None:
    """Stop ``stack``'s processes, the gateway first and Redis last, and remove its record."""
    ours = _ours(stack)
    order = [GATEWAY, *(name for name, _ in reversed(SERVICES)), "redis"]
    deployer_crashed = "deploy" in ours and not _alive(*ours["deploy"])
    _stop_pids(
        {name: ours[name] for name in order if name in ours and name != "redis"},
        log,
        timeout_s=STOP_TIMEOUT_S + settings.drain_timeout_s,
    )
    # Processes of this stack no record names: a service `iserve up` started but had not
    # recorded when it was killed, a worker its agent left behind.
    _stop_strays(
        settings,
        stack,
        {pid for pid, _ in ours.values()},
        log,
        STOP_TIMEOUT_S + settings.drain_timeout_s,
    )
    if deployer_crashed:
        # A deployer that exited cleanly records that it did, and its deployments are
        # restored without spending their restart budget; one that crashed could not.
        # This stop is the operator's: record it for it while Redis answers.
        _record_planned_stop(stack.get("redis_url", ""), log)
    _stop_pids({"redis": ours["redis"]} if "redis" in ours else {}, log)
    (settings.state_dir / STACK_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def temporary_stack(
    env: Mapping[str, str] | None = None,
    *,
    state_dir: Path | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> Iterator[Settings]:
    """A whole stack (embedded Redis, every service, one agent) on free ports in
    ``state_dir`` (default: a temporary directory), for tests and benchmarks.

    ``env`` adds settings (e.g. ``ISERVE_DEVICES``). The process environment names the
    stack while it runs, so clients and CLI subprocesses find it, and is restored after.
    Yields the settings, read after start-up (so ``redis_url`` is set). ``log`` gets
    what ``iserve up`` would print.
    """
    with contextlib.ExitStack() as cleanup:
        if state_dir is None:
            state_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="iserve-")))
        values = {
            "ISERVE_STATE_DIR": str(state_dir),
            "ISERVE_MODELS_ROOT": str(state_dir / "models"),
            **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
            **{var: f"127.0.0.1:{free_port()}" for var in METRICS_ENV.values()},
            GATEWAY_ENV: f"127.0.0.1:{free_port()}",
            **(env or {}),
        }
        saved = {key: os.environ.get(key) for key in [*values, "REDIS_URL"]}
        cleanup.callback(_restore_environment, saved)
        os.environ.pop("REDIS_URL", None)
        os.environ.update(values)
        settings = load_settings()
        interrupts = interrupt_on((signal.SIGTERM,), cleanup)
        # Held until the stop is registered (while it starts, `up`'s own handlers stop it;
        # what it started, it stops when it fails).
        interrupts.hold()
        up(settings, UpOptions(), log=log)
        cleanup.callback(down, settings, lambda _msg: None)
        cleanup.callback(interrupts.hold)  # a second SIGTERM does not cut the stop short
        interrupts.resume()
        yield load_settings()


def _restore_environment(saved: Mapping[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _record_planned_stop(redis_url: str, log) -> None:
    """Mark in Redis that the deployer stopped on purpose (what it marks itself when it
    exits cleanly), so that the next start restores its deployments as after a clean
    stop; nothing when Redis does not answer."""

    async def mark() -> None:
        store = StateStore.from_url(redis_url)
        try:
            await store.mark_deployer_stopped(int(time.time() * 1000))
        finally:
            await store.close()

    try:
        asyncio.run(mark())
    except (StateStoreUnavailable, redis.RedisError, ValueError) as exc:
        log(
            f"the deployer had exited and Redis did not answer ({exc}): the next `iserve up` counts each restore against its deployment's restart budget"
        )


def unrecorded_processes(
    stack_id: str,
    recorded: set[int],
    proc_root: Path = Path("/proc"),
    redis_dir: Path | None = None,
) -> list[int]:
    """Pids of this user's processes whose environment names the stack ``stack_id``
    (STACK_ID_ENV, which every service and the workers its agent starts inherit), and of
    the redis-server running in ``redis_dir`` (the embedded one's data directory: it
    writes its process title over its environment, so no id can be read there), other
    than ``recorded``, this process and the processes above it (a shell that carries
    the id runs `iserve down`, and is not killed by it); none without an id or procfs."""
    if not stack_id:
        return []
    marker = f"{STACK_ID_ENV}={stack_id}".encode()
    spared = {*recorded, *_ancestors(os.getpid(), proc_root)}
    redis_dir = None if redis_dir is None else redis_dir.resolve()
    found = []
    for entry in proc_root.glob("[0-9]*"):
        pid = int(entry.name)
        if pid in spared:
            continue
        try:
            environment = (entry / "environ").read_bytes()
        except OSError:  # another user's, or gone meanwhile
            continue
        if marker in environment.split(b"\0") or _is_redis_in(entry, redis_dir):
            found.append(pid)
    return sorted(found)


def _redis_dir(state_dir: Path) -> Path:
    """The embedded Redis's data directory (its ``--dir``, where its log is too)."""
    return state_dir / "redis"


def log_of(state_dir: Path, name: str) -> Path:
    """The log file of the stack's process ``name``."""
    return (
        _redis_dir(state_dir) / "redis.log"
        if name == "redis"
        else state_dir / "logs" / f"{name}.log"
    )


def _is_redis_in(entry: Path, directory: Path | None) -> bool:
    """Whether the process at ``entry`` (/proc/<pid>) is a redis-server working in
    ``directory`` (its ``--dir``, resolved)."""
    if directory is None:
        return False
    try:
        command = (entry / "comm").read_text().strip()
        cwd = os.readlink(entry / "cwd")
    except OSError:
        return False
    return command == "redis-server" and Path(cwd) == directory


def _stop_strays(
    settings: Settings,
    stack: Mapping,
    recorded: set[int],
    log=lambda _msg: None,
    timeout_s: float = STOP_TIMEOUT_S,
) -> None:
    """Stop the processes of ``stack`` that no record names (``_strays_after_grace``),
    all at once."""
    strays = _strays_after_grace(
        stack.get("stack_id", ""),
        recorded,
        _redis_dir(settings.state_dir) if stack.get("embedded_redis") else None,
    )
    _stop_pids(
        {
            f"unrecorded process {describe_process(pid) or '?'}": (pid, start_time(pid))
            for pid in strays
        },
        log,
        timeout_s=timeout_s,
        together=True,
    )


def _strays_after_grace(
    stack_id: str, recorded: set[int], redis_dir: Path | None = None
) -> list[int]:
    """``unrecorded_processes`` once the stopped services' own helpers have had
    STRAY_GRACE_S to exit with them (the agent's multiprocessing resource tracker
    outlives it by a moment: a clean stop named it as unrecorded, a probe)."""
    deadline = time.monotonic() + STRAY_GRACE_S
    strays = unrecorded_processes(stack_id, recorded, redis_dir=redis_dir)
    while strays and time.monotonic() < deadline:
        time.sleep(0.1)
        for pid in strays:
            _reap(pid)
        found = unrecorded_processes(stack_id, recorded, redis_dir=redis_dir)
        strays = [p for p in found if _alive(p)]
    return strays


def _ancestors(pid: int, proc_root: Path = Path("/proc")) -> set[int]:
    """``pid`` and the processes above it (``PPid`` in ``/proc/<pid>/status``)."""
    seen: set[int] = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        try:
            status = (proc_root / str(pid) / "status").read_text()
        except OSError:
            break
        parent = next(
            (line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "0"
        )
        pid = int(parent) if parent.isdigit() else 0
    return seen


def describe_process(pid: int, proc_root: Path = Path("/proc")) -> str:
    """A process's command line, shortened, for a message ("" when unreadable)."""
    try:
        words = (proc_root / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text if len(text) <= 80 else text[:77] + "..."


def _stop_pids(
    pids: dict[str, tuple[int, int | None]],
    log=lambda _msg: None,
    timeout_s: float = STOP_TIMEOUT_S,
    *,
    together: bool = False,
) -> None:
    """SIGTERM each process (pid, start time or None) in turn, or all at once with
    ``together`` (processes no order matters for: one that ignores SIGTERM then holds up
    the others for ``timeout_s`` once, not each in turn); SIGKILL one still alive
    ``timeout_s`` seconds after its SIGTERM. A pid another process holds now is left
    alone."""
    items = list(pids.items())
    for batch in [items] if together else [[item] for item in items]:
        stopping = []
        for name, (pid, started) in batch:
            if not _alive(pid, started):
                if _alive(pid):
                    log(f"{name} is gone; pid {pid} is another process now, left alone")
                else:  # it said nothing of one that had exited (a probe)
                    log(f"{name} (pid {pid}) had exited already")
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
            stopping.append((name, pid, started))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_alive(p, t) for _, p, t in stopping):
            for _, pid, _ in stopping:
                _reap(pid)
            time.sleep(0.05)
        for name, pid, started in stopping:
            if _alive(pid, started):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                _reap(pid)
            log(f"stopped {name} (pid {pid})")


def reap_children() -> list[tuple[int, int]]:
    """Collect the exit status of every child that has exited (the stack's processes,
    stopped by an ``iserve down`` of another process, or crashed), so none stays a
    zombie; (pid, exit code as ``subprocess`` gives it) of each."""
    reaped = []
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            reaped.append((pid, os.waitstatus_to_exitcode(status)))
    return reaped


def exit_warning(stack: Mapping, pid: int, code: int) -> str | None:
    """What the foreground ``iserve up`` says when the stack's process ``pid`` exited with
    ``code`` unasked (it said nothing: a dead service showed only in `iserve status`);
    None for another child, or a clean stop (code 0, SIGTERM: an ``iserve down``)."""
    name = next((n for n, p in stack.get("pids", {}).items() if p == pid), None)
    if name is None or code in (0, -signal.SIGTERM):
        return None
    state_dir = Path(stack.get("state_dir", "."))
    log = log_of(state_dir, name)
    return (
        f"warning: {name} (pid {pid}) {describe_exit(code)}; see {log}. The stack runs "
        "without it: `iserve down`, then `iserve up` starts it all again"
    )


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines the latest start of the process wrote to ``path`` (earlier
    runs' lines, above its START_MARK, are not this failure's)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    starts = [i for i, line in enumerate(text) if line.startswith(START_MARK)]
    latest = text[starts[-1] + 1 :] if starts else text
    return "\n".join(latest[-lines:]) or "(nothing logged)"


def describe_memory(gib: float) -> str:
    return f"{gib:g} GiB ({int(gib * GIB)} bytes)"
