"""A log of refused authentication: who was turned away, from where, and why.

An operator needs to see token guessing and misconfigured clients, but a client retrying
in a loop must not flood the log. So each (client host, reason) is logged at most once
per ``interval_s`` for each thing it asked for; the refusals in between are counted
into its next line. No secret is logged: the reason names a token id at most, never a
token.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RefusalLog", "client_host"]

# Distinct (host, reason, what) remembered at once; the oldest is forgotten beyond that
# (a forgotten pair is logged again at its next refusal).
MAX_KEYS = 1024


def client_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``,
    ``unix:/path``), without its port: one client's retries share it."""
    kind, _, address = peer.partition(":")
    if kind == "ipv6" and address.startswith("["):
        return address[1 : address.find("]")] if "]" in address else address
    if kind == "ipv4":
        return address.rpartition(":")[0] or address
    return peer or "unknown"


class RefusalLog:
    """``refused(client, reason, what)`` logs "refused WHAT from CLIENT: REASON" at
    WARNING, at most once per ``interval_s`` per (client, reason, what)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        # (client, reason, what) -> (when last logged, refusals since not logged)
        self._seen: OrderedDict[tuple[str, str, str], tuple[float, int]] = OrderedDict()

    def refused(self, client: str, reason: str, what: str) -> None:
        key = (client, reason, what)
        now = self.clock()
        last = self._seen.pop(key, None)
        if last is not None and now - last[0] < self.interval_s:
            self._seen[key] = (last[0], last[1] + 1)
            return
        more = f" ({last[1]} more like it since the last line)" if last and last[1] else ""
        self.logger.warning("refused %s from %s: %s%s", what, client, reason, more)
        self._seen[key] = (now, 0)
        while len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)
