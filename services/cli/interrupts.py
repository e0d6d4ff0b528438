"""Stop signals (SIGTERM, SIGHUP) that unwind this process as Ctrl-C does, and are not lost.

CPython runs a signal's Python handler in the main thread, between two bytecodes; what the
handler raises unwinds the code it lands in. Two ways lose a stop that way, and each left
a whole stack running (CI runs):

- a stop landing in a ``__del__`` or a weakref callback: Python prints the exception
  ("Exception ignored in ...") and drops it; a SIGHUP mid-start and `up` went on to serve.
- a stop arriving just before the main thread enters a blocking call (``time.sleep``, a
  lock, a read): the handler runs when that call returns. A benchmark's process sent
  SIGTERM as it began a 300-second sleep ran on (3 runs in 22 on a loaded machine).

So while the handlers are set, a watcher thread learns of each stop signal as it arrives
(``signal.set_wakeup_fd``: CPython writes the signal's number there) and, when the
handler has not run soon after, sends the signal again to the main thread, ending its
blocking call; and the unraisable hook sends again a stop a finalizer dropped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable

# How long the handler is given to run before its signal is sent again to the main thread.
RESEND_DELAY_S = 0.01
_STOP_WATCHING = 0  # no signal has number 0


class Interrupts:
    """The stop signals received while the handlers are set. Each raises KeyboardInterrupt
    where it lands (so that an uncaught one ends the process as Ctrl-C does, by SIGINT),
    until :meth:`hold`; :meth:`check` raises one received (at the end of each step of a
    start)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.holding = False
        self.previous_hook = sys.unraisablehook
        self._handled = 0  # the handler's runs, for the watcher
        self._raised: BaseException | None = None  # the last, for the unraisable hook
        self._main = threading.main_thread().ident

    def handler(self, signum, _frame) -> None:
        self.received.append(signum)
        self._handled += 1
        if not self.holding:
            self._raised = KeyboardInterrupt(f"signal {signum}")
            raise self._raised

    def hold(self) -> None:
        """From now on a stop signal is recorded, not raised: a second one (or one sent
        again) does not cut short the stop the first began."""
        self.holding = True
        self._raised = None  # its traceback holds the frames it went through

    def check(self) -> None:
        if self.received:
            raise KeyboardInterrupt(f"signal {self.received[0]}")

    def rescue(self, unraisable) -> None:
        """The unraisable hook while the handlers are set."""
        if unraisable.exc_value is not None and unraisable.exc_value is self._raised:
            # Sent again once this finalizer has returned, from another thread: sent from
            # here, it was handled here and lost again. Lost again, it comes back here.
            resend = threading.Timer(
                RESEND_DELAY_S, signal.pthread_kill, (self._main, self.received[-1])
            )
            resend.daemon = True
            resend.start()
            return
        self.previous_hook(unraisable)

    def watch(self, read_fd: int, heeded: frozenset[int], forward_fd: int = -1) -> None:
        """The watcher thread: reads the wakeup fd until _STOP_WATCHING, and passes what
        it reads on to the wakeup fd it replaced (an asyncio loop's), if any."""
        own = 0  # the signals it sent itself, read back from the wakeup fd
        while True:
            handled = self._handled
            data = os.read(read_fd, 512)
            stopping = not data or _STOP_WATCHING in data
            data = data.replace(bytes([_STOP_WATCHING]), b"")
            if data and forward_fd >= 0:
                with contextlib.suppress(OSError):  # full or closed: as CPython's own write
                    os.write(forward_fd, data)
            if stopping:
                return
            stops = [s for s in data if s in heeded]
            mine = min(own, len(stops))
            own -= mine
            if not stops[mine:]:
                continue
            time.sleep(RESEND_DELAY_S)
            if self._handled == handled and not self.holding:
                # Tripped, not handled: the main thread entered a blocking call first.
                own += 1
                signal.pthread_kill(self._main, stops[-1])


def _stop_watching(write_fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # a full pipe: the watcher is reading it
        os.write(write_fd, bytes([_STOP_WATCHING]))


def interrupt_on(signals: Iterable[signal.Signals], cleanup: contextlib.ExitStack) -> Interrupts:
    """While ``cleanup`` is open, each of ``signals`` ends this process as Ctrl-C would,
    unwinding it: a benchmark killed by ``timeout`` or its terminal's close left its
    whole stack running (a probe). A signal ignored now (``nohup``'s SIGHUP) stays
    ignored. Only the main thread may set a handler; elsewhere nothing changes."""
    interrupts = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        return interrupts
    heeded = frozenset(int(s) for s in signals if signal.getsignal(s) is not signal.SIG_IGN)
    if not heeded:
        return interrupts
    # The callbacks run last in, first out: the handlers are put back first, the watcher
    # stopped last, so that no handler of ours is left that nothing watches.
    read_fd, write_fd = os.pipe()
    cleanup.callback(os.close, read_fd)
    cleanup.callback(os.close, write_fd)
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(
        target=interrupts.watch,
        args=(read_fd, heeded, previous_fd),
        name="stop-signal-watcher",
        daemon=True,
    )
    watcher.start()
    cleanup.callback(watcher.join)
    cleanup.callback(_stop_watching, write_fd)
    cleanup.callback(signal.set_wakeup_fd, previous_fd)
    sys.unraisablehook = interrupts.rescue
    cleanup.callback(setattr, sys, "unraisablehook", interrupts.previous_hook)
    for sig in heeded:
        previous = signal.signal(sig, interrupts.handler)
        cleanup.callback(signal.signal, sig, previous)
    return interrupts
