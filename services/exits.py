"""How a process's exit reads in messages: "exited with code 1", "killed by SIGKILL"."""

from __future__ import annotations

import signal


def describe_exit(code: int) -> str:
    """``code`` as ``subprocess`` gives it (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
