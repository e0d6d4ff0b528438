"""Clients of the deployments' workers: one channel and one open ``Session`` per worker.

A request to a worker is one message on the worker's open ``WorkerService.Session``
stream rather than a new call: a new call costs ~0.7 ms round trip on a 2-core machine,
a message on an open stream ~0.3 ms. ``WorkerSession`` demultiplexes the responses by
``stream_id`` into one ``WorkerStream`` per request. When the session call ends (the
worker died, stopped or is unreachable) every stream on it fails with the call's status
and the next request opens a new session.

A cancelled write cancels the whole gRPC call, so writes run in tasks of their own,
never cancelled with the request that made them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable

import grpc

from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc as worker_grpc
from services.grpc_server import channel

STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
SessionRequest = worker_pb.WorkerServiceSessionRequest


# What gRPC's asyncio client reports, as INTERNAL, when a call's batch fails in its core
# (the peer ended a bidirectional call while this side was writing), in place of the
# status the peer sent.
CORE_LOST_STATUS = "Internal error from Core"


class WorkerStreamError(Exception):
    """A generation failed on the worker (its status) or with its session (the call's)."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = ""):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason  # services.errors.IServeError.reason of the worker's error


class WorkerStream:
    """One generation on a session: ``read`` its responses until the one with a finish
    reason; ``close`` (always) cancels it on the worker if it has not finished."""

    def __init__(self, session: WorkerSession, stream_id: int):
        self._session = session
        self._stream_id = stream_id
        self._queue: asyncio.Queue[worker_pb.WorkerServiceGenerateResponse | WorkerStreamError]
        self._queue = asyncio.Queue()
        self._finished = False

    def deliver(self, item: worker_pb.WorkerServiceGenerateResponse | WorkerStreamError) -> None:
        self._queue.put_nowait(item)

    async def read(self) -> worker_pb.WorkerServiceGenerateResponse:
        """The next response; WorkerStreamError when the generation failed."""
        item = await self._queue.get()
        if type(item) is WorkerStreamError:
            self._finished = True
            raise item
        if item.finish_reason:
            self._finished = True
        return item

    def close(self) -> None:
        """Forget the stream; tell the worker to stop it unless it already ended."""
        self._session.forget(self._stream_id, cancel=not self._finished)
        self._finished = True


class WorkerSession:
    """One open ``WorkerService.Session`` call and the generations multiplexed on it.

    Use from one event loop only. ``start`` opens a stream; a background task reads the
    call and hands each response to its stream.
    """

    def __init__(self, stub: worker_grpc.WorkerServiceStub):
        self._call = stub.Session()
        self._streams: dict[int, WorkerStream] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._writes: set[asyncio.Task] = set()
        self.ended: WorkerStreamError | None = None
        self._reader = asyncio.create_task(self._read_forever(), name="worker-session-reader")

    @property
    def is_open(self) -> bool:
        return self.ended is None

    @property
    def busy(self) -> bool:
        """Whether a generation is still streaming on this session."""
        return bool(self._streams)

    def start(self, request: worker_pb.WorkerServiceGenerateRequest) -> WorkerStream:
        """Send ``request`` as a new stream. If the session has ended, or ends later, the
        stream's ``read`` raises the session's error."""
        stream_id = next(self._ids)
        stream = WorkerStream(self, stream_id)
        if self.ended is not None:
            stream.deliver(self.ended)
        else:
            self._streams[stream_id] = stream
            self._write(SessionRequest(stream_id=stream_id, generate=request))
        return stream

    def forget(self, stream_id: int, cancel: bool) -> None:
        """Drop a stream; with ``cancel``, tell the worker to stop generating it."""
        if self._streams.pop(stream_id, None) is None or not cancel or self.ended is not None:
            return
        self._write(
            SessionRequest(stream_id=stream_id, cancel=worker_pb.WorkerServiceSessionCancel())
        )

    async def close(self) -> None:
        """Cancel the call; streams still open fail with CANCELLED."""
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, *self._writes, return_exceptions=True)

    def _write(self, request: worker_pb.WorkerServiceSessionRequest) -> None:
        """Write ``request`` from a task of its own, in call order (the lock is FIFO), so
        that no request's cancellation can cancel the write."""
        task = asyncio.create_task(self._send(request))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _send(self, request: worker_pb.WorkerServiceSessionRequest) -> None:
        # A failed write means the call has ended: the reader fails every stream with
        # the call's status.
        async with self._write_lock:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self._call.write(request)

    async def _read_forever(self) -> None:
        ended = WorkerStreamError(grpc.StatusCode.UNAVAILABLE, "the worker ended the session")
        try:
            read = self._call.read
            streams = self._streams
            while (message := await read()) is not grpc.aio.EOF:
                stream = streams.get(message.stream_id)
                if stream is None:
                    continue  # cancelled or closed by the scheduler already
                if message.HasField("generate"):
                    stream.deliver(message.generate)
                else:
                    error = message.error
                    code = STATUS_BY_NUMBER.get(error.status_code, grpc.StatusCode.UNKNOWN)
                    stream.deliver(WorkerStreamError(code, error.message, error.reason))
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.INTERNAL and details == CORE_LOST_STATUS:
                # gRPC's client reads this in place of the status when the worker ends
                # the session while a request is being written to it (a worker draining
                # or stopping): the session ended, as at EOF. Passed on as INTERNAL, a
                # request sent to a removed deployment's draining worker failed so,
                # where it is told the deployment was removed.
                code, details = (
                    grpc.StatusCode.UNAVAILABLE,
                    f"the worker ended the session ({details})",
                )
            ended = WorkerStreamError(code, details)
        except asyncio.CancelledError:
            ended = WorkerStreamError(grpc.StatusCode.CANCELLED, "the scheduler closed the session")
            raise
        finally:
            self.ended = ended
            for stream in self._streams.values():
                stream.deliver(ended)
            self._streams.clear()


class WorkerClients:
    """A channel and a ``WorkerSession`` per worker ``host:port``, created on first use.

    gRPC channels reconnect on their own, so a channel is kept after a worker error and
    only the session is opened again; ``retain`` closes those of addresses no deployment
    uses any more, once their generations have ended.
    """

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, WorkerSession] = {}

    def stub(self, address: str) -> worker_grpc.WorkerServiceStub:
        chan = self._channels.get(address)
        if chan is None:
            chan = self._channels[address] = channel(address)
        return worker_grpc.WorkerServiceStub(chan)

    def session(self, address: str) -> WorkerSession:
        """The open session to ``address``, opening one if there is none."""
        session = self._sessions.get(address)
        if session is None or not session.is_open:
            session = self._sessions[address] = WorkerSession(self.stub(address))
        return session

    async def retain(self, addresses: Iterable[str]) -> None:
        """Close the sessions and channels of every address not in ``addresses``, except
        those of sessions with generations still streaming: the worker of a deployment
        being removed drains them, and closing the session would cut them. A later call
        closes such a session once it is idle."""
        keep = set(addresses) | {a for a, session in self._sessions.items() if session.busy}
        await self._close_except(keep)

    async def _close_except(self, keep: set[str]) -> None:
        sessions = [self._sessions.pop(a) for a in list(self._sessions) if a not in keep]
        channels = [self._channels.pop(a) for a in list(self._channels) if a not in keep]
        closing = [s.close() for s in sessions] + [c.close() for c in channels]
        if closing:
            await asyncio.gather(*closing)

    async def close(self) -> None:
        """Close every session, cutting the generations still streaming, and channel."""
        await self._close_except(set())
