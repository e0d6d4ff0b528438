"""The files CPU ranks share memory through (``monitor_agent.engine.shm_collectives``):
where they lie, how they are named, and the sweep of a dead rank's.

Rank 0 creates ``/dev/shm/iserve-<its pid>-<random>`` and unlinks it once every rank has
mapped it, so a group that starts leaves nothing behind. A rank 0 killed in between
(SIGKILL while the group sets up) cannot; the agent, which reaps it, removes what its pid
named (:func:`remove_shared_files`). Kept apart from the collectives so that the agent
does not import torch for it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import psutil

SHM_DIR = "/dev/shm"
_PREFIX = "iserve-"


def new_shared_file_name(pid: int | None = None) -> str:
    """A fresh path for a group's shared file, naming the process that creates it."""
    pid = os.getpid() if pid is None else pid
    return os.path.join(SHM_DIR, f"{_PREFIX}{pid}-{secrets.token_hex(6)}")


def remove_shared_files(pid: int, directory: str = SHM_DIR) -> list[str]:
    """Remove the shared files process ``pid`` created and left (it has exited); the
    paths removed."""
    return _unlink(Path(directory).glob(f"{_PREFIX}{pid}-*"))


def remove_orphaned_shared_files(directory: str = SHM_DIR) -> list[str]:
    """Remove the shared files of processes that no longer run (an agent killed with its
    workers left them); the paths removed. Another stack's live workers keep theirs."""

    def orphaned(path: Path) -> bool:
        pid = path.name[len(_PREFIX) :].split("-", 1)[0]
        return pid.isdigit() and not psutil.pid_exists(int(pid))

    return _unlink(filter(orphaned, Path(directory).glob(f"{_PREFIX}*-*")))


def _unlink(paths: Iterable[Path]) -> list[str]:
    """Remove ``paths`` (one gone meanwhile is skipped); those removed."""
    removed = []
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(str(path))
    return removed
