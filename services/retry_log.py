"""How a loop that retries every round says that its rounds fail.

The state store down is one spell: a line when it starts and one when it ends, not a
traceback every round (a tester counted 45 in 20 s of Redis down in an agent's log).
Any other error is logged with its traceback each time: it is a defect to be read.
"""

from __future__ import annotations

import logging


class RetryLog:
    """The failures of the rounds of ``what`` (e.g. "reaping workers"), told to ``log``."""

    def __init__(self, log: logging.Logger, what: str):
        self._log = log
        self._what = what
        self._failing = False  # the last round failed: its spell is said already

    def unavailable(self, exc: Exception) -> None:
        """A round failed for want of a service (the state store): said once a spell."""
        if not self._failing:
            self._log.warning("%s failed, retrying each round: %s", self._what, exc)
        self._failing = True

    def error(self) -> None:
        """A round failed otherwise (call from the ``except`` block): its traceback."""
        self._log.exception("%s failed; retrying", self._what)
        self._failing = True

    def succeeded(self) -> None:
        """A round went through: the end of a spell of failures is said."""
        if self._failing:
            self._log.info("%s works again", self._what)
        self._failing = False
