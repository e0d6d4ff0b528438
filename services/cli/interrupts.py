"""Stop signals (SIGTERM, SIGHUP) that unwind this process as Ctrl-C does, and are not lost.

CPython runs a signal's Python handler in the main thread, between two bytecodes; what the
handler raises unwinds the code it lands in. Two ways lose a stop that way, and each left
a whole stack running (CI runs):

- a stop landing in a ``__del__`` or a weakref callback: Python prints the exception
  ("Exception ignored in ...") and drops it; a SIGHUP mid-start and `up` went on to serve.
- a stop arriving just before the main thread enters a blocking call (``time.sleep``, a
  lock, a read): the handler runs when that call returns. A benchmark's process sent
  SIGTERM as it began a 300-second sleep ran on (4 runs in 22 on a loaded machine).

So while the handlers are set, a watcher thread learns of each stop signal as it arrives
(``signal.set_wakeup_fd``: CPython writes the signal's number there) and, until the
handler has run, wakes the main thread with a signal of its own (WAKE, whose handler does
nothing): the blocking call returns, and CPython runs the handlers it had put off. A wake
never raises, so one too many costs nothing. A stop a finalizer dropped is raised again
by the watcher (``_thread.interrupt_main``) once the unraisable hook has told it.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable

# After a stop signal, the main thread is woken at these delays until its handler has run.
WAKE_DELAYS_S = (0.01, 0.1, 1.0)
# A stop a finalizer dropped is raised again this long after (the main thread leaves the
# unraisable hook and the finalizer first).
RAISE_AGAIN_DELAY_S = 0.01
# The main thread's wake-up call: a real-time signal nothing else in iserve uses (none
# where the system has no real-time signals, macOS: no wakes there).
WAKE = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None
_STOP_WATCHING = 0  # no signal has number 0
_RAISE_AGAIN = 255  # nor this one: the unraisable hook's word to the watcher


class Interrupts:
    """The stop signals received while the handlers are set. Each raises KeyboardInterrupt
    where it lands (so that an uncaught one ends the process as Ctrl-C does, by SIGINT),
    until :meth:`hold`; :meth:`check` raises one received (at the end of each step of a
    start)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.holding = False
        self.held = 0  # received while holding
        self.previous_hook = sys.unraisablehook
        self._handled = 0  # the handler's runs, for the watcher
        self._raised: BaseException | None = None  # the last, for the unraisable hook
        self._write_fd = -1  # the watcher's pipe
        self._rescuing = False  # in the unraisable hook

    def handler(self, signum, _frame) -> None:
        self.received.append(signum)
        self._handled += 1
        if self.holding:
            self.held += 1
            return
        if self._rescuing:  # raised in the hook, it would be lost there: asked again
            self._raise_again()
            return
        self._raised = KeyboardInterrupt(f"signal {signum}")
        raise self._raised

    def hold(self) -> None:
        """From now on a stop signal is recorded, not raised: a second one does not cut
        short the stop the first began (:meth:`raise_held` raises it after)."""
        self.holding = True
        self._raised = None  # its traceback holds the frames it went through

    def resume(self) -> None:
        """Undo :meth:`hold`, raising a stop signal held meanwhile."""
        self.holding = False
        self.raise_held()

    def raise_held(self) -> None:
        if self.held:
            self.held = 0
            raise KeyboardInterrupt(f"signal {self.received[-1]}")

    def check(self) -> None:
        if self.received:
            raise KeyboardInterrupt(f"signal {self.received[0]}")

    def rescue(self, unraisable) -> None:
        """The unraisable hook while the handlers are set: a stop a finalizer dropped is
        raised again by the watcher, once the finalizer has returned (raised from here,
        it would be lost again in this hook)."""
        if unraisable.exc_value is not None and unraisable.exc_value is self._raised:
            self._rescuing = True
            try:
                self._raise_again()
            finally:
                self._rescuing = False
            return
        self.previous_hook(unraisable)

    def _raise_again(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe: the watcher is reading it
            os.write(self._write_fd, bytes([_RAISE_AGAIN]))

    def watch(self, read_fd: int, heeded: frozenset[int], forward_fd: int) -> None:
        """The watcher thread: reads the wakeup fd until _STOP_WATCHING, and passes what
        it reads on to the wakeup fd it replaced (an asyncio loop's), if any."""
        main = threading.main_thread().ident
        wakes: list[float] = []  # when to wake the main thread, unless handled since
        raise_at: float | None = None  # when to raise again a stop a finalizer dropped
        handled = self._handled
        poller = select.poll()  # not select(): no limit on the descriptor's number
        poller.register(read_fd, select.POLLIN)
        while True:
            due = min([*wakes[:1], *([raise_at] if raise_at is not None else [])], default=None)
            timeout_ms = None if due is None else max(0.0, due - time.monotonic()) * 1000
            if not poller.poll(timeout_ms):
                now = time.monotonic()
                if raise_at is not None and raise_at <= now:
                    # Raised once the main thread has left the hook and, likely, the
                    # finalizer: lost again, it is asked again.
                    raise_at = None
                    if not self.holding:
                        handled = self._handled
                        _thread.interrupt_main(self.received[-1])
                        wakes = [now + delay for delay in WAKE_DELAYS_S]
                    continue
                if not wakes or wakes[0] > now:
                    continue
                wakes.pop(0)
                # Sent only while WAKE's handler is a watcher's (another's may have
                # been put in since).
                if self._handled == handled and not self.holding and _wakes():
                    signal.pthread_kill(main, WAKE)
                else:
                    wakes.clear()
                continue
            data = os.read(read_fd, 512)
            ours = data.translate(None, bytes([_STOP_WATCHING, _RAISE_AGAIN]))
            if ours and forward_fd >= 0:
                with contextlib.suppress(OSError):  # full or closed: as CPython's own write
                    os.write(forward_fd, ours)
            if not data or _STOP_WATCHING in data:
                return
            if _RAISE_AGAIN in data and raise_at is None:
                raise_at = time.monotonic() + RAISE_AGAIN_DELAY_S
            if heeded.intersection(data):
                handled = self._handled
                now = time.monotonic()
                wakes = [now + delay for delay in WAKE_DELAYS_S]


def _woken(_signum, _frame) -> None:
    """WAKE's handler: nothing; the main thread's blocking call returned."""


def _wakes() -> bool:
    return WAKE is not None and signal.getsignal(WAKE) is _woken


def _stop_watching(write_fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # a full pipe: the watcher is reading it
        os.write(write_fd, bytes([_STOP_WATCHING]))


def interrupt_on(signals: Iterable[signal.Signals], cleanup: contextlib.ExitStack) -> Interrupts:
    """While ``cleanup`` is open, each of ``signals`` ends this process as Ctrl-C would,
    unwinding it: a benchmark killed by ``timeout`` or its terminal's close left its
    whole stack running (a probe). A signal ignored now (``nohup``'s SIGHUP) stays
    ignored. Only the main thread may set a handler; elsewhere nothing changes. When
    ``cleanup`` closes, a stop signal is held (recorded) first, and raised at its end."""
    interrupts = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        return interrupts
    heeded = frozenset(int(s) for s in signals if signal.getsignal(s) is not signal.SIG_IGN)
    if not heeded:
        return interrupts
    # The callbacks run last in, first out: first the stop signals are held, then the
    # watcher stopped, then the handlers put back (WAKE's last: the watcher may send it).
    cleanup.callback(interrupts.raise_held)
    read_fd, write_fd = os.pipe()
    cleanup.callback(os.close, read_fd)
    cleanup.callback(os.close, write_fd)
    os.set_blocking(write_fd, False)
    interrupts._write_fd = write_fd
    # Taken where nothing handles it, or an outer watcher does (a stack's start within a
    # temporary stack); another's is not sent.
    if WAKE is not None and signal.getsignal(WAKE) in (signal.SIG_DFL, _woken):
        cleanup.callback(signal.signal, WAKE, signal.signal(WAKE, _woken))
    sys.unraisablehook = interrupts.rescue
    cleanup.callback(setattr, sys, "unraisablehook", interrupts.previous_hook)
    for sig in heeded:
        cleanup.callback(signal.signal, sig, signal.signal(sig, interrupts.handler))
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    cleanup.callback(signal.set_wakeup_fd, previous_fd)
    watcher = threading.Thread(
        target=interrupts.watch,
        args=(read_fd, heeded, previous_fd),
        name="stop-signal-watcher",
        daemon=True,
    )
    watcher.start()
    cleanup.callback(watcher.join)
    cleanup.callback(_stop_watching, write_fd)
    cleanup.callback(interrupts.hold)
    return interrupts
