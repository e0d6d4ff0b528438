"""Which processes `iserve up`/`down` take for the stack's (services.cli.stack): a pid
names a process only with its start time, since the system reuses pids after a crash or
a reboot; and two `up`s at once on one state directory are one too many."""

from __future__ import annotations

import contextlib
import fcntl
import json
import signal
import subprocess
import sys
import time

import pytest
import redis

from services.cli import stack
from services.cli.stack import UpOptions, _alive, _record_planned_stop, _stop_pids, start_time
from services.settings import load_settings
from services.state import keys


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(10)


def test_a_reused_pid_is_not_the_stack_s_process(sleeper):
    started = start_time(sleeper.pid)
    assert started is not None
    assert _alive(sleeper.pid, started) and _alive(sleeper.pid)
    assert not _alive(sleeper.pid, started + 1)  # the pid, another process's now


def test_down_leaves_alone_a_process_that_took_a_recorded_pid(sleeper):
    """A stale stack.json (every process killed, then the pid reused): `down` killed
    whatever held the pid now."""
    said = []
    _stop_pids({"gateway": (sleeper.pid, start_time(sleeper.pid) + 1)}, said.append)
    assert sleeper.poll() is None
    assert said == [f"gateway is gone; pid {sleeper.pid} is another process now, left alone"]
    _stop_pids({"gateway": (sleeper.pid, start_time(sleeper.pid))}, said.append, timeout_s=10)
    assert sleeper.wait(10) is not None


def test_down_names_a_process_that_had_exited_before_it():
    """A scheduler dead before `iserve down` went unmentioned among the stopped (a probe)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    said = []
    _stop_pids({"scheduler": (gone.pid, None)}, said.append)
    assert said == [f"scheduler (pid {gone.pid}) had exited already"]


def test_processes_stopped_together_wait_out_one_timeout_not_one_each():
    """`down` stops the unrecorded processes together: three that ignore SIGTERM took
    three whole stop timeouts, one after another (a probe)."""
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    stubborn = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        for proc in stubborn:  # each has set its handler (a slow start on a loaded machine)
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        said: list[str] = []
        started = time.monotonic()
        _stop_pids(
            {f"stray {p.pid}": (p.pid, start_time(p.pid)) for p in stubborn},
            said.append,
            timeout_s=3.0,
            together=True,
        )
        took = time.monotonic() - started
        # Killed: -SIGKILL, or 0 where _stop_pids reaped the child first (Popen then finds
        # no status to read; they sleep for 60 s, so nothing else ends them at once).
        assert all(p.wait(5) in (-signal.SIGKILL, 0) for p in stubborn)
        assert said == [f"stopped stray {p.pid} (pid {p.pid})" for p in stubborn]
        assert 3.0 <= took < 7.0, took  # one timeout; in turn it was 9 s
    finally:
        for proc in stubborn:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


def test_a_stale_stack_file_does_not_block_up(sleeper, tmp_path, monkeypatch):
    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    (tmp_path / "stack.json").write_text(
        json.dumps(
            {"pids": {"gateway": sleeper.pid}, "started": {"gateway": start_time(sleeper.pid) + 1}}
        )
    )
    assert stack.stack_running(load_settings()) == {}


def test_a_record_without_start_times_counts_a_pid_only_while_it_runs_that_process(
    sleeper, tmp_path, monkeypatch
):
    """An older iserve recorded pids alone: after a crash, a pid another process took was
    the stack's to `up`, `status` and `down`, which stopped it (a tester upgrading)."""
    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    (tmp_path / "stack.json").write_text(json.dumps({"pids": {"scheduler": sleeper.pid}}))
    recorded = stack.read_stack_file(tmp_path)
    assert stack._ours(recorded) == {"scheduler": (sleeper.pid, stack._NOT_OURS)}
    assert stack.stack_running(load_settings()) == {}
    said = []
    _stop_pids(stack._ours(recorded), said.append)
    assert sleeper.poll() is None
    assert said == [f"scheduler is gone; pid {sleeper.pid} is another process now, left alone"]
    # A process that runs the recorded one's command is taken for it, and stopped.
    service = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "-m", "scheduler_svc"]
    )
    try:
        _wait_for_exec(service.pid, sys.executable.encode())
        (tmp_path / "stack.json").write_text(json.dumps({"pids": {"scheduler": service.pid}}))
        recorded = stack.read_stack_file(tmp_path)
        assert stack._ours(recorded) == {"scheduler": (service.pid, start_time(service.pid))}
        assert stack.stack_running(load_settings()) == recorded
        _stop_pids(stack._ours(recorded), said.append, timeout_s=10)
        assert service.wait(10) is not None
    finally:
        service.kill()
        service.wait(10)


def test_a_second_up_while_one_starts_is_refused(tmp_path, monkeypatch):
    """Two `iserve up` at once started two Redis servers on one append-only file, and
    the second took the first's services for its own."""
    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    with open(tmp_path / "up.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RuntimeError, match="another `iserve up` is starting the stack"):
            stack.up(load_settings(), UpOptions(), log=lambda _m: None)
    assert not (tmp_path / "stack.json").exists()


def test_down_records_the_planned_stop_a_crashed_deployer_could_not(redis_url):
    """Without the mark, the next start counted each restore against its deployment's
    restart budget, though `up` had said it would not."""
    said = []
    _record_planned_stop(redis_url, said.append)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.getdel(keys.deployer_stopped()) is not None
    finally:
        client.close()
    _record_planned_stop("redis://127.0.0.1:1/0", said.append)
    assert "counts each restore against its deployment's restart budget" in said[-1]


def test_a_failure_shows_the_log_lines_of_this_start_only(tmp_path):
    """Logs are appended to across runs: a service that failed to start showed the tail
    of earlier runs' lines (a stale traceback read as this failure's cause)."""
    log = tmp_path / "model.log"
    for run, said in enumerate(("old traceback", "this run's error")):
        proc = stack._spawn("json.tool", {"PATH": "/usr/bin:/bin"}, log)
        proc.wait(30)
        with log.open("a") as out:
            out.write(f"{said} {run}\n")
    tail = stack._tail(log)
    assert tail.endswith("this run's error 1") and "old traceback" not in tail
    assert log.read_text().count(stack.START_MARK) == 2
    assert stack._tail(tmp_path / "none.log") == "(no log)"


def test_unrecorded_processes_are_this_stack_s_by_their_environment(tmp_path):
    from services.cli.stack import unrecorded_processes

    def process(pid: int, environ: bytes | None) -> None:
        (tmp_path / str(pid)).mkdir()
        if environ is not None:
            (tmp_path / str(pid) / "environ").write_bytes(environ)

    process(10, b"PATH=/bin\0ISERVE_STACK_ID=abc\0")  # this stack's, unrecorded
    process(11, b"ISERVE_STACK_ID=abc\0")  # this stack's, recorded
    process(12, b"ISERVE_STACK_ID=abcd\0")  # another stack's
    process(13, b"X=ISERVE_STACK_ID=abc\0")  # the id inside another variable
    process(14, None)  # another user's: unreadable
    (tmp_path / "self").mkdir()
    assert unrecorded_processes("abc", {11}, tmp_path) == [10]
    # The shell that runs `iserve down` with the id in its environment is spared.
    import os

    (tmp_path / str(os.getpid())).mkdir()
    (tmp_path / str(os.getpid()) / "status").write_text("Name:\tiserve\nPPid:\t10\n")
    (tmp_path / "10" / "status").write_text("Name:\tbash\nPPid:\t1\n")
    assert unrecorded_processes("abc", {11}, tmp_path) == []
    # A stack.json from before the id was recorded: nothing is looked for.
    assert unrecorded_processes("", set(), tmp_path) == []


def test_the_embedded_redis_is_found_by_its_directory(tmp_path):
    """redis-server writes its process title over its environment, so the stack id it
    inherited cannot be read; it is the redis-server working in the stack's Redis
    directory (a shell there is not)."""
    from services.cli.stack import unrecorded_processes

    proc, redis_dir, elsewhere = tmp_path / "proc", tmp_path / "redis", tmp_path / "other"
    redis_dir.mkdir()
    elsewhere.mkdir()
    for pid, comm, cwd in [
        (20, "redis-server", redis_dir),  # the stack's, unrecorded
        (21, "bash", redis_dir),  # an operator's shell in that directory
        (22, "redis-server", elsewhere),  # another Redis
        (23, "redis-server", redis_dir),  # the stack's, recorded
    ]:
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "environ").write_bytes(b"redis-server *:6379\0")
        (proc / str(pid) / "comm").write_text(comm + "\n")
        (proc / str(pid) / "cwd").symlink_to(cwd)
    assert unrecorded_processes("abc", {23}, proc, redis_dir=redis_dir) == [20]
    assert unrecorded_processes("abc", {23}, proc) == []  # an operator's Redis: none


@pytest.fixture
def quiet_stack(tmp_path, monkeypatch, redis_url):
    """`iserve up` on the test's Redis whose services are sleepers that serve at once:
    what `up` does around its steps, without starting the services."""
    from services.settings import GATEWAY_ENV, METRICS_ENV, SERVICE_ENV

    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("REDIS_URL", redis_url)
    for var in [*SERVICE_ENV.values(), *METRICS_ENV.values(), GATEWAY_ENV]:
        monkeypatch.setenv(var, "127.0.0.1:0")
    spawned: list[subprocess.Popen] = []

    def spawn(_module, _env, _log):
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return spawned[-1]

    monkeypatch.setattr(stack, "_spawn", spawn)
    monkeypatch.setattr(stack, "wait_http", lambda *_a: True)
    monkeypatch.setattr(stack, "wait_for_restored", lambda *_a, **_k: [])
    yield spawned
    for proc in spawned:
        proc.kill()
        proc.wait(10)


def test_a_stop_signal_lost_where_it_landed_still_stops_the_start(quiet_stack, monkeypatch):
    """A signal's KeyboardInterrupt raised inside a weakref callback is printed ("Exception
    ignored in: ... WeakSet") and lost: a CI run sent SIGHUP to a starting `up`, which went
    on to serve, the signal gone. The start checks for it after its steps."""

    def swallowing(*_args):
        with contextlib.suppress(KeyboardInterrupt):  # Python prints "Exception ignored"
            signal.raise_signal(signal.SIGHUP)
        return True

    monkeypatch.setattr(stack, "wait_serving", swallowing)
    settings = load_settings()
    # A terminal's SIGHUP (a suite run under `nohup` inherits it ignored, and so kept).
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt):
            stack.up(settings, UpOptions(), log=lambda _m: None)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # put back
    finally:
        signal.signal(signal.SIGHUP, inherited)
    assert quiet_stack and all(p.wait(20) is not None for p in quiet_stack)
    assert not (settings.state_dir / "stack.json").exists()


def test_a_stop_signal_held_as_the_start_ends_stops_what_started(quiet_stack, monkeypatch):
    """A stop signal that comes as `up` puts its handlers back is held, then raised: `up`
    stops what it started before it raises (raised after its start, it left the stack
    running and unrecorded to the caller)."""
    real = stack._up

    def then_a_stop(settings, options, log, interrupts):
        started = real(settings, options, log, interrupts)
        interrupts.hold()  # as the cleanup does first
        signal.raise_signal(signal.SIGTERM)
        return started

    monkeypatch.setattr(stack, "_up", then_a_stop)
    monkeypatch.setattr(stack, "wait_serving", lambda *_a: True)
    settings = load_settings()
    with pytest.raises(KeyboardInterrupt):
        stack.up(settings, UpOptions(), log=lambda _m: None)
    assert quiet_stack and all(p.wait(20) is not None for p in quiet_stack)
    assert not (settings.state_dir / "stack.json").exists()


def test_a_stop_while_the_embedded_redis_starts_leaves_no_redis(tmp_path, monkeypatch):
    """A stop signal after redis-server was started but before `start_redis` returned (its
    PING wait) left it running, unrecorded, and `iserve down` found no stack (a probe).
    The stopped start also stops what of its stack it had not recorded."""
    from services.ports import free_port
    from services.redis_embedded import find_redis_server
    from services.settings import GATEWAY_ENV, METRICS_ENV, SERVICE_ENV

    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    for var in [*SERVICE_ENV.values(), *METRICS_ENV.values(), GATEWAY_ENV]:
        monkeypatch.setenv(var, "127.0.0.1:0")
    spawned = []

    def stopped_as_it_starts(data_dir, *_args, **_kwargs):
        data_dir.mkdir(parents=True, exist_ok=True)
        command = [find_redis_server(), "--port", str(free_port()), "--save", ""]
        spawned.append(subprocess.Popen(command, cwd=data_dir, stdout=subprocess.DEVNULL))
        raise KeyboardInterrupt("signal 15")  # before it is recorded

    monkeypatch.setattr(stack, "start_redis", stopped_as_it_starts)
    with pytest.raises(KeyboardInterrupt):
        stack.up(load_settings(), UpOptions(), log=lambda _m: None)
    try:
        assert spawned[0].wait(20) is not None
    finally:
        spawned[0].kill()
    assert not (tmp_path / "stack.json").exists()


def test_a_foreground_up_holds_the_stop_signals_and_nohup_s_stays_ignored(quiet_stack, monkeypatch):
    """Once started, a foreground `up` waits for its stop signals with sigtimedwait: left
    unblocked in between, a SIGTERM ended it by default with its stack running. And a
    SIGHUP that `nohup` ignores stops no start."""
    monkeypatch.setattr(stack, "wait_serving", lambda *_a: True)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        seen = []
        monkeypatch.setattr(
            stack,
            "_check_distinct_addresses",
            lambda _s: seen.append(signal.getsignal(signal.SIGHUP)),
        )
        settings = load_settings()
        before = signal.getsignal(signal.SIGTERM)
        stack.up(settings, UpOptions(), log=lambda _m: None, hold_stop_signals=True)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert {signal.SIGINT, signal.SIGTERM} <= held, held
        # nohup's ignored SIGHUP is not blocked: a blocked signal is queued even when
        # ignored, and the foreground up's sigtimedwait took it as a stop (a probe).
        assert signal.SIGHUP not in held and stack.heeded_stop_signals() == (
            signal.SIGINT,
            signal.SIGTERM,
        )
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stack.STOP_SIGNALS)
        signal.signal(signal.SIGHUP, previous)
        stack.down(load_settings(), lambda _m: None)


def test_redis_is_told_by_the_title_it_writes_over_its_arguments():
    titled = subprocess.Popen(
        ["redis-server 127.0.0.1:6379", "60"], executable="/bin/sleep"
    )  # what redis-server's argv reads once it runs
    try:
        _wait_for_exec(titled.pid, b"redis-server 127.0.0.1:6379")
        assert stack._pid_start_if_ours("redis", titled.pid) == start_time(titled.pid)
        assert stack._pid_start_if_ours("gateway", titled.pid) == stack._NOT_OURS
    finally:
        titled.kill()
        titled.wait(10)


def _wait_for_exec(pid: int, argv0: bytes, timeout_s: float = 10.0) -> None:
    """Until ``pid`` runs its own program: a child just forked reads as its parent (the
    test process's command line) until it has exec'd (a CI run asked in between)."""
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] != argv0:
        assert time.monotonic() < deadline, f"pid {pid} did not exec {argv0!r}"
        time.sleep(0.01)
