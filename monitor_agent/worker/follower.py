"""A worker rank other than 0: it serves nothing and runs the steps rank 0 broadcasts.

The steps run on a thread (``DistributedModel.follow``), because a collective blocks in
C++ and Python signal handlers run only on the main thread between bytecodes; the main
thread waits for that thread while it watches for SIGTERM and for the agent's death, and
leaves with ``os._exit`` when either comes, since a thread blocked in a collective cannot
be stopped any other way.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from monitor_agent.engine.distributed import DistributedModel, GroupLost

log = logging.getLogger("iserve.worker")

POLL_S = 0.5


def run_follower(model: DistributedModel, *, parent_pid: int, announce: Callable[[], None]) -> bool:
    """Announce readiness, then follow rank 0 until it sends STOP (True) or the group is
    lost (False). On SIGTERM or SIGINT, or once ``parent_pid`` (if not 0) is no longer
    this process's parent, the process exits at once with code 0."""
    outcome: list[bool] = []

    def follow() -> None:
        try:
            model.follow()
            outcome.append(True)
        except GroupLost as exc:
            log.error("%s", exc)
            outcome.append(False)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: stop.set())
    thread = threading.Thread(target=follow, name="follower", daemon=True)
    thread.start()
    announce()
    while thread.is_alive():
        thread.join(POLL_S)
        if stop.is_set():
            _exit_now("stopping on a signal")
        if parent_pid and os.getppid() != parent_pid:
            _exit_now(f"parent process {parent_pid} exited; stopping")
    if outcome and outcome[0]:
        log.info("rank 0 sent stop")
    return bool(outcome and outcome[0])


def _exit_now(reason: str) -> None:
    log.info("%s", reason)
    logging.shutdown()
    os._exit(0)
