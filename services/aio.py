"""Cancelling asyncio tasks so that they end.

On Python 3.11, :func:`asyncio.wait_for` loses a cancellation that arrives in the loop
turn in which the call it waits for completes (CPython gh-86296; 3.12 rewrote
``wait_for`` on :func:`asyncio.timeout`). redis-py sends every command under
``wait_for`` when its socket timeout is set, as ours is, so a task cancelled while it
sends a Redis command can go on as if it had never been cancelled: a loop that should
stop runs on, and whoever awaits it waits for ever (seen: the deployer's reconciler, a
few times in a hundred cancellations). :func:`cancel_and_wait` cancels again until the
tasks have ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

# How long a cancelled task has to end before it is cancelled again.
RECANCEL_AFTER_S = 0.5


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future], *, recancel_after_s: float = RECANCEL_AFTER_S
) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again any that is
    still running ``recancel_after_s`` later. Their exceptions are retrieved (not
    raised): the caller stops them, it does not want their outcome."""
    pending = {asyncio.ensure_future(task) for task in tasks}
    ended = set(pending)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_after_s)
    for task in ended:
        if not task.cancelled():
            task.exception()
