"""Draining a server: refuse new calls, let the calls in flight finish, then stop.

On SIGTERM, ``run_server`` turns health NOT_SERVING and awaits the servicer's drain
(``ISERVE_DRAIN_TIMEOUT_S`` seconds at most) before it stops the server, which cancels
what is still running. While draining, the server keeps listening: a new call gets
UNAVAILABLE with a message saying the server is draining, and a health check answers
NOT_SERVING.

Why not only ``grpc.aio.Server.stop(grace)``, which also lets calls in flight finish:
it closes the listening socket first, so a new call fails with "failed to connect to all
addresses ... Connection refused" (a client cannot tell a draining server from a dead
one) and the health service cannot be asked any more (checked with grpcio 1.85).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.errors import Unavailable

log = logging.getLogger("iserve.drain")
# Beyond its drain, how long a worker gets to exit (close the engine, tell the other
# ranks to stop) before its agent sends SIGKILL.
WORKER_STOP_MARGIN_S = 5.0


def worker_stop_s(drain_timeout_s: float) -> float:
    """How long an agent may take to stop one group's workers: rank 0 drains and exits
    first, then the other ranks, each within the drain plus WORKER_STOP_MARGIN_S."""
    return 2 * (drain_timeout_s + WORKER_STOP_MARGIN_S)


def _draining(server: str) -> str:
    return f"{server} is draining"


def refused_as_draining(details: str, server: str) -> bool:
    """Whether a call's UNAVAILABLE ``details`` are ``server``'s refusal while it drains
    (:meth:`InFlight.enter`): another instance at its address may take the call."""
    return details.startswith(_draining(server))


class InFlight:
    """Counts a server's calls in flight; once :meth:`drain` starts, refuses new ones.

    Use from one event loop only. ``server`` names the server in the refusal message
    (e.g. ``"scheduler"``).
    """

    def __init__(self, server: str) -> None:
        self.server = server
        self.count = 0
        self.draining = False
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        """Count one more call; Unavailable (nothing counted) once draining."""
        if self.draining:
            raise Unavailable(
                f"{_draining(self.server)}: it is shutting down and takes no new "
                "requests; retry on another instance or once it is back"
            )
        self.count += 1

    def leave(self) -> None:
        """A call counted by :meth:`enter` has ended."""
        self.count -= 1
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    def admit(self, context: grpc.aio.ServicerContext) -> None:
        """:meth:`enter` for a gRPC call, left when the call ends however it ends
        (finished, failed, cancelled by the client or by the server stopping)."""
        self.enter()
        context.add_done_callback(lambda _context: self.leave())

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new calls from now on and wait up to ``timeout_s`` seconds for the calls
        in flight to end. True when none is left; False when some still run (the caller
        stops them)."""
        self.draining = True
        if self.count:
            log.info(
                "%s draining: waiting up to %g s for %d call(s)", self.server, timeout_s, self.count
            )
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except TimeoutError:
                log.warning(
                    "%s: %d call(s) still running after %g s; cancelling them",
                    self.server,
                    self.count,
                    timeout_s,
                )
                return False
        log.info("%s drained", self.server)
        return True
