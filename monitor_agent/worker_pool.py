"""A warm worker pool: engine workers forked from a process that has imported torch.

A fresh worker process spends most of its start importing torch and the engine (about
1.3 s of a 1.6 s start on a 2-core VM), and a profiling job starts and stops one per
layout and batch. The pool is Python's own ``multiprocessing`` fork server
(``multiprocessing.get_context("forkserver")``) with the engine's modules preloaded: the
agent starts it once, and each worker is a fork of it, so torch is imported once per
node instead of once per worker. Deployments and profiling jobs both go through the
supervisor, so both use it.

What a forked worker does before it runs ``monitor_agent.worker.process.main``: leaves
the server's session (so a signal to its process group reaches it alone), points its
stdin at /dev/null and its stdout and stderr at its log file, takes the environment the
supervisor built for it, and watches its own parent (the fork server, which exits when
the agent does) instead of the agent. Nothing in the server has run a torch operator, so
no thread pool exists to be broken by the fork; each worker sizes its own
(``torch.set_num_threads``, its CPU mask) as a fresh process does.

``ISERVE_WORKER_POOL=0`` turns it off: workers are then started with ``subprocess`` as
``python -m monitor_agent.worker``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import psutil

from services.settings import WITHHELD_FROM_WORKERS

log = logging.getLogger("iserve.agent.pool")

# Imported once in the fork server: torch and everything a worker imports to load and
# serve a model.
PRELOAD = ("torch", "monitor_agent.worker.process", "monitor_agent.engine.engine")
_WORKER_MODULE = ("-m", "monitor_agent.worker")
# How long a poll waits for the exit code of a worker the fork server has reaped (its
# code is on the way through a pipe: milliseconds; this blocks the caller that long at most).
REAPED_CODE_WAIT_S = 2.0


def worker_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without what :data:`WITHHELD_FROM_WORKERS` names."""
    return {k: v for k, v in env.items() if k not in WITHHELD_FROM_WORKERS}


@contextlib.contextmanager
def _withheld_from_the_fork_server() -> Iterator[None]:
    """The agent's environment without :data:`WITHHELD_FROM_WORKERS` while the fork
    server may start: it is a new process taking the agent's environment, and a worker
    forked from it keeps that process's first environment in ``/proc/PID/environ``
    whatever it sets in ``os.environ`` afterwards."""
    withheld = {k: os.environ.pop(k) for k in WITHHELD_FROM_WORKERS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(withheld)


def _let_go_of_the_fork_server() -> None:
    """Close this child's copy of the fork server's "alive" pipe.

    The fork server exits once no process holds the pipe's write end, and it hands that
    end to every process it forks (for multiprocessing's own children, which must keep
    it alive). A worker holding it would keep the fork server alive after the agent
    dies (SIGKILL), and with it the worker, which stops only when its parent, the fork
    server, is gone: orphans holding device memory and ports. Without it the fork
    server exits with the agent and the worker follows (its parent watch).
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - where _serve_one left the fd
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # noqa: SLF001


def _run_worker(args: list[str], env: dict[str, str], log_path: str) -> None:
    """Body of a forked worker (runs in the child)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    _let_go_of_the_fork_server()
    if "--parent-pid" in args:
        # The fork server is this process's parent; it exits when the agent does.
        args[args.index("--parent-pid") + 1] = str(os.getppid())
    from monitor_agent.worker.process import main

    code = 1
    try:
        code = main(args)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _nothing() -> None:
    """What :meth:`WorkerPool.start`'s first fork runs."""


class PooledProcess:
    """A forked worker, with the part of ``subprocess.Popen`` the supervisor uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process

    @property
    def pid(self) -> int:
        return int(self._process.pid or 0)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        """The exit code, or None while the worker runs. The fork server reaps its
        children and then writes the code to a pipe: a worker already gone (or a zombie
        about to be reaped) waits up to ``REAPED_CODE_WAIT_S`` for it, so a death the
        process table shows is never read as "still running" (a stop that came then
        recorded a killed worker as stopped, its cause lost)."""
        code = self._process.exitcode
        if code is None and self.pid and not process_running(self.pid):
            self._process.join(REAPED_CODE_WAIT_S)
            code = self._process.exitcode
        return code


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has). A killed worker's
    main thread is a zombie while its other threads still exit, and waitpid reports
    nothing until they have: the process table says "exited" before the exit code can be
    read (tens of milliseconds for a worker holding gigabytes)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # cannot tell: taken as running, as before
        return True


class WorkerPool:
    """The node's fork server; :meth:`start` warms it, :meth:`spawn` forks a worker."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD):
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))

    def start(self) -> None:
        """Start the fork server now, not at the first worker. It imports ``PRELOAD``
        before it forks anything; a thread forks a process that does nothing and says
        "ready" once that ran, when a worker starts in a fraction of a second (the log
        said so as the server started, and the first workers on a restarted node then
        waited 20 s, behind torch's import on a loaded machine)."""
        from multiprocessing import forkserver

        with _withheld_from_the_fork_server():
            forkserver.ensure_running()
        started = time.monotonic()
        log.info("warm worker pool starting (preloading %s)", ", ".join(PRELOAD))

        def warmed() -> None:
            process = self._context.Process(target=_nothing, name="iserve-pool-warm", daemon=True)
            try:
                process.start()
                process.join()
            # The agent stopping meanwhile (TypeError: multiprocessing's stop had cleared
            # the server's descriptors, a CI run).
            except (OSError, EOFError, ValueError, TypeError) as exc:
                log.warning("warm worker pool did not start: %s", exc)
                return
            log.info(
                "warm worker pool ready (preloaded %s; %.1f s)",
                ", ".join(PRELOAD),
                time.monotonic() - started,
            )

        threading.Thread(target=warmed, name="iserve-pool-warm", daemon=True).start()

    def stop(self) -> None:
        """Stop the fork server and wait for it to exit (the agent's stop, once its
        workers are stopped). It would exit on its own once the agent is gone, but only
        after whatever it is doing (importing torch after a restart takes seconds), and
        `iserve down`, which waits for the agent, returned with it still running.
        SIGTERM, then multiprocessing's own stop: close its "alive" pipe and reap it."""
        from multiprocessing import forkserver

        server = forkserver._forkserver  # noqa: SLF001 - the pid and stop are private
        pid = server._forkserver_pid  # noqa: SLF001
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(OSError):
            server._stop()  # noqa: SLF001
        log.info("warm worker pool stopped (pid %d)", pid)

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> PooledProcess:
        """Fork a worker for ``argv`` (a ``python -m monitor_agent.worker …`` line)."""
        if tuple(argv[1:3]) != _WORKER_MODULE:
            raise ValueError(f"the pool runs only monitor_agent.worker, not {argv[:3]}")
        process = self._context.Process(
            target=_run_worker,
            args=(list(argv[3:]), dict(env), str(log_path)),
            name="iserve-worker",
            daemon=True,
        )
        with _withheld_from_the_fork_server():  # (re)starts the fork server if it is gone
            process.start()
        return PooledProcess(process)
