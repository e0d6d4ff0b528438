"""`iserve up --detach` and `iserve down` as a user runs them: separate processes, the
CLI's own transport (set up before `up` writes the stack's tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.ports import free_port
from services.settings import GATEWAY_ENV, METRICS_ENV, SERVICE_ENV
from tests.integration.helpers import run_cli, wait_for

pytestmark = pytest.mark.integration


def test_up_with_authentication_on_starts_and_down_stops(tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")},
        "ISERVE_AUTH": "on",
        "ISERVE_STATE_DIR": str(tmp_path / "state"),
        "ISERVE_DEVICES": "1",
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
        **{var: f"127.0.0.1:{free_port()}" for var in METRICS_ENV.values()},
        GATEWAY_ENV: f"127.0.0.1:{free_port()}",
    }
    env.pop("REDIS_URL", None)
    try:
        up = run_cli(env, "up", "--detach")
        # It lists the deployments kept from before with the admin token it just wrote
        # (an UNAUTHENTICATED error before).
        assert up.returncode == 0, up.stderr
        assert "iserve is up" in up.stdout and "could not list" not in up.stdout, up.stdout
        status = run_cli(env, "status", "--json")
        assert status.returncode == 0, status.stderr
        # The gateway never reaches Redis: its environment holds no URL with the
        # password (a chat template linked to /proc/self/environ showed it), while the
        # services' does.
        pids = json.loads((tmp_path / "state" / "stack.json").read_text())["pids"]

        def variables(pid: int) -> set[bytes]:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            return {e.split(b"=", 1)[0] for e in raw.split(b"\0")}

        assert b"REDIS_URL" not in variables(pids["gateway"])
        assert b"REDIS_URL" in variables(pids["model"])
    finally:
        down = run_cli(env, "down")
    assert down.returncode == 0 and "stopped" in down.stdout, down.stderr
    # Started again from a shell without ISERVE_AUTH, the stack would take anyone's
    # calls: refused, nothing started; ISERVE_AUTH=off starts it open on purpose.
    unset = {k: v for k, v in env.items() if k != "ISERVE_AUTH"}
    refused = run_cli(unset, "up", "--detach")
    assert refused.returncode == 1, refused.stdout
    tokens = tmp_path / "state" / "tokens"
    advice = (
        ", and ISERVE_AUTH is not set now: started so, it would take calls from anyone who "
        "reaches its ports. Set ISERVE_AUTH=on to check tokens, or ISERVE_AUTH=off to start "
        "it open on purpose"
    )
    assert refused.stderr.strip() == (
        f"error: the stack of {tmp_path / 'state'} was started with ISERVE_AUTH=on (it "
        f"holds {tokens / 'admin'}){advice}"
    )
    assert run_cli(unset, "status").returncode == 1
    assert not (tmp_path / "state" / "stack.json").exists()
    # The admin token given in the environment then: only the service token was written.
    (tokens / "admin").unlink()
    refused = run_cli(unset, "up", "--detach")
    assert refused.returncode == 1 and f"(it holds {tokens / 'service'})" in refused.stderr
    # A token given now, on a state directory that never checked tokens.
    fresh = {**unset, "ISERVE_STATE_DIR": str(tmp_path / "fresh"), "ISERVE_ADMIN_TOKEN": "a" * 32}
    refused = run_cli(fresh, "up", "--detach")
    assert refused.stderr.strip() == f"error: ISERVE_ADMIN_TOKEN is set{advice}"
    assert not (tmp_path / "fresh" / "stack.json").exists()
    try:
        opened = run_cli({**unset, "ISERVE_AUTH": "off"}, "up", "--detach")
        assert opened.returncode == 0, opened.stderr
    finally:
        down = run_cli(unset, "down")
    assert down.returncode == 0 and "stopped" in down.stdout, down.stderr


def test_up_s_flags_override_its_variables_and_status_names_the_stack_s_models_root(tmp_path):
    """`--devices` replaces a bad ISERVE_DEVICES (which refused it before), and `iserve
    status --json` from a shell without ISERVE_MODELS_ROOT names the root the stack
    reads checkpoints from, not that shell's default."""
    import json

    root = tmp_path / "checkpoints"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")},
        "ISERVE_STATE_DIR": str(tmp_path / "state"),
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
        **{var: "127.0.0.1:0" for var in METRICS_ENV.values()},
        GATEWAY_ENV: f"127.0.0.1:{free_port()}",
    }
    env.pop("REDIS_URL", None)
    try:
        up = run_cli(
            {**env, "ISERVE_DEVICES": "0", "ISERVE_MODELS_ROOT": str(root)},
            *("up", "--detach", "--devices", "1"),
        )
        assert up.returncode == 0, up.stderr
        status = run_cli(env, "status", "--json")
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["models_root"] == str(root)
        assert [len(node["devices"]) for node in shown["nodes"]] == [1]
    finally:
        down = run_cli(env, "down")
    assert down.returncode == 0, down.stderr


def test_up_where_its_log_directory_cannot_be_made_says_what_it_was_doing(tmp_path):
    """It printed only "[Errno 17] File exists: '.../logs'"."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "logs").write_text("not a directory")
    env = _stack_env(state)
    up = run_cli(env, "up", "--detach")
    assert up.returncode == 1
    assert f"cannot prepare the stack's directories under {state}" in up.stderr, up.stderr
    assert "set ISERVE_STATE_DIR" in up.stderr


def _working_in(directory: Path) -> list[int]:
    """The processes whose working directory lies under ``directory``."""
    found = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if os.readlink(cwd).startswith(str(directory)):
                found.append(int(cwd.parent.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("where", ["stack.json", "redis/redis.conf"])
def test_up_on_a_full_disk_names_the_file_and_leaves_nothing_running(tmp_path, where):
    """It printed only "[Errno 28] No space left on device" (a write's error names no
    file). A full disk is /dev/full linked where the file's temporary copy goes."""
    state = tmp_path / "state"
    (state / where).parent.mkdir(parents=True)
    partial = state / f"{where}.partial"
    partial.symlink_to("/dev/full")
    env = _stack_env(state)
    up = run_cli(env, "up", "--detach")
    assert up.returncode == 1
    assert (
        f"error: the stack did not start: [Errno 28] No space left on device: '{state / where}'; "
        "free space on that disk" in up.stderr
    ), up.stderr
    assert not os.path.lexists(partial) and not (state / "stack.json").exists()
    down = run_cli(env, "down")
    assert "no stack recorded" in down.stdout, down.stdout
    assert not _working_in(state)  # no embedded Redis (it runs in its data directory)


def test_up_with_an_operators_redis_that_is_not_there_or_refuses_names_redis_url(tmp_path):
    """`iserve up` blamed the agent ("agent did not become ready; last log lines: …")
    some 13 s later, the cause quoted from the agent's log (a probe)."""
    from services.redis_embedded import start_redis

    state = tmp_path / "state"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")},
        "ISERVE_STATE_DIR": str(state),
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
        **{var: "127.0.0.1:0" for var in METRICS_ENV.values()},
        GATEWAY_ENV: f"127.0.0.1:{free_port()}",
    }
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    up = run_cli({**env, "REDIS_URL": nowhere}, "up", "--detach")
    assert up.returncode == 1
    assert f"error: cannot reach Redis at {nowhere} (REDIS_URL): " in up.stderr, up.stderr
    assert "unset REDIS_URL" in up.stderr and "did not become ready" not in up.stderr
    assert not (state / "stack.json").exists()  # nothing started, nothing recorded

    (tmp_path / "redis").mkdir()
    redis_proc, url = start_redis(tmp_path / "redis", appendonly=False)
    try:
        wrong = url.replace(url[url.index(":", 8) + 1 : url.index("@")], "wrong")
        up = run_cli({**env, "REDIS_URL": wrong}, "up", "--detach")
        assert up.returncode == 1
        assert "(REDIS_URL): state store (Redis) at" in up.stderr, up.stderr
        assert "check the user and password in REDIS_URL" in up.stderr
        assert "wrong" not in up.stderr  # the password is never shown
        assert not (state / "stack.json").exists()
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def test_a_gateway_whose_services_are_not_there_names_the_one_it_could_not_reach(tmp_path):
    """A 503 said only gRPC's "failed to connect to all addresses; ... 127.0.0.1:50064"
    (a probe, with the scheduler killed): which service is it?"""
    import httpx

    gateway = f"127.0.0.1:{free_port()}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")},
        "ISERVE_STATE_DIR": str(tmp_path / "state"),
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},  # nothing there
        GATEWAY_ENV: gateway,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "gateway"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_for(lambda: _answers(f"http://{gateway}/health"), timeout=60)
        reply = httpx.get(f"http://{gateway}/v1/models", timeout=30)
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith("the iserve deployment service is not reachable: "), message
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_any_free_port_is_chosen_once_and_reported(tmp_path):
    """A "host:0" (any free port) for every metrics server, the gateway and a service: `up`
    chooses the ports, and `iserve status` names them and each answers there (status
    printed ":0" before, so the metrics could not be found)."""
    import json

    import httpx

    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")},
        "ISERVE_STATE_DIR": str(tmp_path / "state"),
        "ISERVE_DEVICES": "1",
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
        **{var: "127.0.0.1:0" for var in METRICS_ENV.values()},
        **{SERVICE_ENV[name]: "127.0.0.1:0" for name in ("estimator", "model", "deploy")},
        GATEWAY_ENV: "127.0.0.1:0",
    }
    env.pop("REDIS_URL", None)
    # In the foreground this time: `iserve down` from another shell ends it too.
    up = _up_in_the_foreground(env)
    try:
        assert wait_for(lambda: run_cli(env, "status").returncode == 0, timeout=180), _exited(up)
        status = run_cli(env, "status", "--json")
        assert status.returncode == 0, status.stderr
        services = json.loads(status.stdout)["services"]
        assert all(s["serving"] for s in services.values()), services
        for name, service in services.items():
            for url in (service["address"], service["metrics"]):
                assert ":0/" not in url and not url.endswith(":0"), (name, url)
            assert httpx.get(service["metrics"], timeout=10).status_code == 200, name
        # A gateway of one's own, in the foreground, with the same "host:0" addresses:
        # it calls the services at the ports `up` chose (it dialled port 0 before: 503).
        gateway = f"127.0.0.1:{free_port()}"
        foreground = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "gateway"],
            env={**env, GATEWAY_ENV: gateway},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert wait_for(lambda: _answers(f"http://{gateway}/health"), timeout=60)
            reply = httpx.post(
                f"http://{gateway}/v1/chat/completions",
                json={"model": "nothing-here", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert reply.status_code == 404, reply.text
        finally:
            foreground.terminate()
            foreground.wait(timeout=30)
    finally:
        down = run_cli(env, "down")
    assert down.returncode == 0 and "stopped" in down.stdout, down.stderr
    try:
        out, _ = up.communicate(timeout=30)  # it blocked until a signal before
    except subprocess.TimeoutExpired:
        up.kill()
        raise
    assert up.returncode == 0 and "the stack was stopped (iserve down)" in out, out


def _exited(proc: subprocess.Popen) -> str:
    """What a process that should be running printed, if it exited."""
    if proc.poll() is None:
        return "still running"
    return f"exited {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}"


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_after_the_stack_was_killed_starts_its_embedded_redis_again(tmp_path):
    """Every process of the stack killed (a crash, a reboot without `iserve down`):
    stack.json still names the embedded Redis, which is gone. `up` starts it again on
    its data instead of taking it for the operator's Redis and failing, and no message
    shows Redis's password."""
    import json
    import signal

    state = tmp_path / "state"
    env = _stack_env(state)
    password = None
    try:
        first = run_cli(env, "up", "--detach")
        assert first.returncode == 0, first.stderr
        pids = json.loads((state / "stack.json").read_text())["pids"]
        # One service crashed: `up` names it and says how to bring it back (it said
        # only "a stack is already running").
        # And its Redis: its log is Redis's own, not in logs/ (it said logs/ for both).
        for name in ("redis", "estimator"):
            os.kill(pids[name], signal.SIGKILL)
            assert wait_for(lambda name=name: not _running(pids[name]), timeout=30)
            if name == "redis":
                # Every service still answers its health check: the hint names Redis.
                status = run_cli(env, "status")
                assert status.returncode == 1
                assert f"hint: redis exited (see {state / 'redis' / 'redis.log'})" in (
                    status.stderr
                ), status.stderr
        partial = run_cli(env, "up", "--detach")
        assert partial.returncode == 1
        assert (
            f"the stack from {state} is running without its estimator, redis (exited; see "
            f"{state / 'logs' / 'estimator.log'}, {state / 'redis' / 'redis.log'})"
        ) in partial.stderr, partial.stderr
        assert "`iserve down`, then `iserve up` starts it all again" in partial.stderr
        # `iserve status` says the same, where it showed DOWN and no more; and of one
        # that runs but does not answer, which.
        os.kill(pids["scheduler"], signal.SIGSTOP)
        status = run_cli(env, "status")
        assert status.returncode == 1
        log = state / "logs"
        # Once for both, as `up` says it (a line each repeated the advice).
        assert (
            f"hint: estimator, redis exited (see {log / 'estimator.log'}, "
            f"{state / 'redis' / 'redis.log'}): `iserve down`, then `iserve up` starts it all "
            "again"
        ) in status.stderr, status.stderr
        assert status.stderr.count("starts it all again") == 1, status.stderr
        assert (
            f"hint: scheduler runs (pid {pids['scheduler']}) but does not answer at "
            f"{env['ISERVE_SCHEDULER_ADDR']}: starting, stopped (kill -STOP) or stuck; see "
            f"{log / 'scheduler.log'}"
        ) in status.stderr, status.stderr
        for pid in pids.values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: all(not _running(p) for p in pids.values()), timeout=30)
        again = run_cli(env, "up", "--detach")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "started embedded redis-server" in again.stdout, again.stdout
        password = (state / "redis" / "password").read_text().strip()
        assert password not in again.stdout + again.stderr
        assert run_cli(env, "status").returncode == 0
        assert (state / "logs").stat().st_mode & 0o077 == 0  # the operator's alone
    finally:
        down = run_cli(env, "down")
    assert down.returncode == 0, down.stderr
    logs = "".join(p.read_text(errors="replace") for p in (state / "logs").glob("*.log"))
    assert password is not None and password not in logs


def test_a_down_while_up_starts_is_told_as_a_stop_not_a_service_that_failed(tmp_path):
    """`up` said "model did not become ready; last log lines: … SIGTERM received"."""
    import json
    import signal

    state = tmp_path / "state"
    env = _stack_env(state)
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "up", "--detach"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def started_a_service() -> bool:
            try:
                return "model" in json.loads((state / "stack.json").read_text())["pids"]
            except (OSError, ValueError, KeyError):
                return False

        assert wait_for(started_a_service, timeout=60)
        # Held while `down` runs: a loaded machine could otherwise finish the start first.
        up.send_signal(signal.SIGSTOP)
        try:
            down = run_cli(env, "down")
        finally:
            up.send_signal(signal.SIGCONT)
        assert down.returncode == 0, down.stderr
        _out, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            run_cli(env, "down")
    assert up.returncode == 1, err
    assert "error: the stack was stopped by `iserve down` (pid " in err, err
    assert "did not become ready" not in err
    assert not (state / "stack.json").exists()
    assert not _working_in(state)


def test_down_stops_the_stack_s_processes_no_record_names(tmp_path):
    """`iserve up` SIGKILLed between starting a service and recording it left that
    service running, found by nothing. Every service carries the stack's id in its
    environment, recorded before any starts; `down` stops those no record names."""
    import json
    import signal

    state = tmp_path / "state"
    env = _stack_env(state)
    pids: dict = {}
    try:
        first = run_cli(env, "up", "--detach")
        assert first.returncode == 0, first.stderr
        stack = json.loads((state / "stack.json").read_text())
        pids = dict(stack["pids"])
        # As a kill between their spawn and their record would have left it.
        # The embedded Redis too (it carries the id since it starts first).
        for name in ("gateway", "scheduler", "redis"):
            del stack["pids"][name]
        (state / "stack.json").write_text(json.dumps(stack))
        down = run_cli(env, "down")
        assert down.returncode == 0, down.stderr
        for name, module in (("gateway", "gateway_svc"), ("scheduler", "scheduler_svc")):
            said = f"stopped unrecorded process {sys.executable} -m {module} (pid {pids[name]})"
            assert said in down.stdout, down.stdout
        said = [line for line in down.stdout.splitlines() if f"(pid {pids['redis']})" in line]
        assert said and "stopped unrecorded process" in said[0] and "redis" in said[0], (
            said,
            down.stdout,
        )
        assert not [n for n, p in pids.items() if _running(p)], pids
    finally:
        for pid in pids.values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _up_in_the_foreground(env: dict[str, str]) -> subprocess.Popen:
    """`iserve up` without --detach, its output captured, on a terminal's SIGHUP: a
    suite run under `nohup` passes its ignored SIGHUP on, which `up` keeps ignored. Set
    by a Python that then execs `up`, not by a ``preexec_fn``: Python code run between
    fork and exec in this process, whose gRPC threads run, aborted the child once
    ("epoll_wait error: Bad file descriptor", a CI run; the subprocess docs warn of it)."""
    return subprocess.Popen(
        [sys.executable, "-c", _WITH_DEFAULT_SIGHUP, "-m", "services.cli.main", "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# Exec's the Python command line that follows with SIGHUP's default action.
_WITH_DEFAULT_SIGHUP = (
    "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _stack_env(state) -> dict[str, str]:
    """The environment of a stack of one device in ``state`` on ports of its own, with its
    embedded Redis (no ISERVE_* or REDIS_URL of the caller's)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")},
        "ISERVE_STATE_DIR": str(state),
        "ISERVE_DEVICES": "1",
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
        **{var: f"127.0.0.1:{free_port()}" for var in METRICS_ENV.values()},
        GATEWAY_ENV: f"127.0.0.1:{free_port()}",
    }
    env.pop("REDIS_URL", None)
    return env


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_up_stopped_while_it_starts_leaves_no_stack_behind(tmp_path, sig):
    """`iserve up` stopped while its services start (a service manager's stop, `timeout`,
    a closed terminal): SIGTERM and SIGHUP stop what it started, as Ctrl-C does. A probe
    found the whole stack running, recorded nowhere, `down` saying there was none. (After
    a SIGKILL, `iserve down` stops what stack.json names; a process killed between its
    spawn and its record is missed, so no test kills it there: orphans on ports other
    tests are given broke them.)"""
    recorded = 3  # Redis and two services: mid-start
    import json
    import signal
    import time

    state = tmp_path / "state"
    env = _stack_env(state)
    up = _up_in_the_foreground(env)
    pids: dict = {}
    try:

        def started() -> bool:
            nonlocal pids
            try:
                pids = json.loads((state / "stack.json").read_text())["pids"]
            except (OSError, ValueError, KeyError):
                return False
            return len(pids) >= recorded

        assert wait_for(started, timeout=120), _exited(up)
        up.send_signal(getattr(signal, sig))
        out, _ = up.communicate(timeout=120)
        assert "iserve is up" not in out, out  # stopped while it started
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_running(p) for p in pids.values()):
            time.sleep(0.1)
        assert not [n for n, p in pids.items() if _running(p)], (pids, out)
        assert not (state / "stack.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
        run_cli(env, "down")
        for pid in pids.values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_foreground_up_says_when_a_service_of_its_stack_dies(tmp_path):
    """A service killed under a foreground `iserve up` showed only in `iserve status`;
    up's own output, where an operator watches, said nothing. Its terminal's close
    (SIGHUP) then stops the stack as Ctrl-C does: it ended `up` alone, the stack left
    running (`iserve down` from elsewhere is test_any_free_port_is_chosen_once_and_reported's)."""
    import json
    import signal

    state = tmp_path / "state"
    env = _stack_env(state)
    up = _up_in_the_foreground(env)
    pids: dict = {}
    try:
        assert wait_for(lambda: run_cli(env, "status").returncode == 0, timeout=180), _exited(up)
        pids = json.loads((state / "stack.json").read_text())["pids"]
        pid = pids["estimator"]
        os.kill(pid, signal.SIGKILL)
        # Reaped (its /proc entry gone): `up` has seen it. A killed process with threads
        # shows as a zombie before it can be reaped, its threads still exiting.
        assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30)
        up.send_signal(signal.SIGHUP)
        out, _ = up.communicate(timeout=60)
        assert not (state / "stack.json").exists(), out
        assert wait_for(lambda: not any(_running(p) for p in pids.values()), timeout=30), out
    finally:
        if up.poll() is None:
            up.kill()
        down = run_cli(env, "down")
    assert down.returncode == 0, down.stderr
    assert (
        f"warning: estimator (pid {pid}) killed by SIGKILL; see {state / 'logs' / 'estimator.log'}"
    ) in out, out
    # The services its stop stopped are not said to have died.
    assert out.count("warning:") == 1, out


def test_the_embedded_redis_listens_on_iserve_redis_port_and_a_busy_one_is_refused(tmp_path):
    """Its port was a free one, named nowhere the operator could set (a probe wrote it
    into the state directory's redis/port)."""
    import json
    import socket

    state = tmp_path / "state"
    env = _stack_env(state)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        up = run_cli({**env, "ISERVE_REDIS_PORT": str(busy)}, "up", "--detach")
        assert up.returncode == 1
        assert f"embedded Redis (ISERVE_REDIS_PORT) 127.0.0.1:{busy}" in up.stderr, up.stderr
    bad = run_cli({**env, "ISERVE_REDIS_PORT": "70000"}, "up", "--detach")
    assert bad.returncode != 0 and "ISERVE_REDIS_PORT must be at most 65535" in bad.stderr
    port = free_port()
    try:
        up = run_cli({**env, "ISERVE_REDIS_PORT": str(port)}, "up", "--detach")
        assert up.returncode == 0, up.stderr
        assert json.loads((state / "stack.json").read_text())["redis_url"].endswith(
            f"@127.0.0.1:{port}/0"
        )
    finally:
        down = run_cli(env, "down")
    assert down.returncode == 0, down.stderr


def test_two_servers_given_one_port_are_refused_before_anything_starts(tmp_path):
    """Two services on one port both started (gRPC binds with port reuse): `up` said the
    stack was up, and calls went to either ("UNIMPLEMENTED: Method not found!"); the
    embedded Redis on a service's port failed later with a traceback (a probe)."""
    state = tmp_path / "state"
    env = _stack_env(state)
    shared = env[SERVICE_ENV["model"]]
    up = run_cli({**env, SERVICE_ENV["deploy"]: shared}, "up", "--detach")
    assert up.returncode == 1
    assert (
        f"deploy ({SERVICE_ENV['deploy']}) and model ({SERVICE_ENV['model']}) are both given "
        f"port {shared.rpartition(':')[2]}"
    ) in up.stderr, up.stderr
    redis_on_it = run_cli({**env, "ISERVE_REDIS_PORT": shared.rpartition(":")[2]}, "up", "--detach")
    assert redis_on_it.returncode == 1
    assert "embedded Redis (ISERVE_REDIS_PORT) and model" in redis_on_it.stderr
    assert "Traceback" not in redis_on_it.stderr
    assert not (state / "stack.json").exists()
