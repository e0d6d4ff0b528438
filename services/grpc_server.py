"""The gRPC bootstrap every iserve process uses.

``run_server`` starts a ``grpc.aio`` server with ``grpc.health.v1``, server reflection
and the error interceptor, serves until SIGTERM/SIGINT and then stops gracefully: with a
``drain`` (:mod:`services.drain`), calls in flight first get up to ``drain_timeout_s``
seconds to finish while new ones are refused.
Servicers raise ``services.errors.IServeError`` subclasses; the interceptor turns them
into status codes with the error's message and logs each failed call with its
request id. Anything else becomes INTERNAL with a one-line message (and a logged
traceback), never a bare exception text dump.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import inspect
import logging
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from services import transport
from services.aio import cancel_and_wait
from services.auth.interceptor import AuthInterceptor
from services.auth.policy import ADMIN, OPERATORS
from services.auth.tokens import Authenticator
from services.errors import REASON_KEY, InvalidArgument, IServeError
from services.ids import check_request_id
from services.metrics import RpcMetrics
from services.settings import DEFAULT_DRAIN_TIMEOUT_S
from services.transport import CHANNEL_OPTIONS, Transport

log = logging.getLogger("iserve.grpc")
# Seconds past the grace a stop may take before every thread's stack is written to the
# log (faulthandler): a stop that hangs then says where.
STOP_STACKS_AFTER_S = 10.0

Drain = Callable[[float], Awaitable[object]]
"""Refuse new calls and wait up to the given seconds for those in flight (``InFlight.drain``)."""


# The longest request id a log line shows as it was sent.
_LOGGED_ID_CHARS = 128


def logged_request_id(request: object) -> str:
    """The request's id as a log line shows it: as sent when it is printable ASCII (what
    a valid id is), else escaped (``ascii``) and cut, as the id is logged before it is
    checked: a newline in it wrote a line of the client's own into the log."""
    rid = getattr(request, "request_id", "") or "-"
    if not isinstance(rid, str):
        return "-"
    if len(rid) <= _LOGGED_ID_CHARS and rid.isascii() and rid.isprintable():
        return rid
    cut = "..." if len(rid) > _LOGGED_ID_CHARS else ""
    return ascii(rid[:_LOGGED_ID_CHARS]) + cut


def _code_of(exc: BaseException) -> grpc.StatusCode:
    return exc.code if isinstance(exc, IServeError) else grpc.StatusCode.INTERNAL


# Bytes a status message takes on the wire at most (percent-encoded in grpc-message).
# A client's trailers are limited to 8 KiB by default: a longer message, such as one
# repeating a megabyte the client sent, reached it as a transport error in place of the
# status (a fuzzing tester).
MAX_DETAILS_BYTES = 4096


def wire_details(message: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``message``, cut so that its grpc-message encoding takes at most ``limit`` bytes,
    saying how much was left out."""
    used = 0
    for at, char in enumerate(message):
        # Printable ASCII but "%" goes as it is; anything else as %XX per UTF-8 byte.
        used += (
            1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "replace"))
        )
        if used > limit - 40:  # room for the note
            return f"{message[:at]}... ({len(message) - at} more characters)"
    return message


async def _abort_for(
    exc: BaseException, method: str, request: object, context: grpc.aio.ServicerContext
):
    rid = logged_request_id(request)
    if isinstance(exc, IServeError):
        details = wire_details(str(exc))
        log.info("%s request_id=%s -> %s: %s", method, rid, exc.code.name, details)
        reason = ((REASON_KEY, exc.reason[:200]),) if exc.reason else ()
        if getattr(exc, "caller_role", ADMIN) not in OPERATORS:
            # A tenant's token (the auth interceptor, outside this one's reach of the
            # call's caller, marks its errors): Redis's address was in them (a probe).
            details = wire_details(exc.told_to_tenants())
        await context.abort(exc.code, details, trailing_metadata=reason)
    log.exception("%s request_id=%s failed", method, rid)
    await context.abort(
        grpc.StatusCode.INTERNAL,
        wire_details(f"internal error in {method}: {type(exc).__name__}: {exc}"),
    )


# The server's clock for a call's deadline starts when its headers arrive, after the
# client's: a client whose deadline passed hangs up while the server still sees a few
# milliseconds left (2 ms seen on a busy 2-core box). A hang-up this close to the deadline
# is taken for the deadline.
DEADLINE_SKEW_S = 0.05


def ended_by_client(context: grpc.aio.ServicerContext, budget_s: float | None) -> grpc.StatusCode:
    """How a request the client ended counts: DEADLINE_EXCEEDED when its deadline had
    passed (what the client saw), else CANCELLED. ``budget_s`` is the time the call had
    left when it arrived (None: no deadline); a hang-up within a tenth of it, at most
    DEADLINE_SKEW_S, before the server's deadline counts as the deadline."""
    remaining = context.time_remaining()
    if remaining is None or budget_s is None:
        return grpc.StatusCode.CANCELLED
    if remaining <= min(DEADLINE_SKEW_S, budget_s / 10):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain errors to gRPC status codes and logs each call with its request id;
    with ``metrics``, counts each call by method and status code."""

    def __init__(self, metrics: RpcMetrics | None = None):
        self._count = metrics.count if metrics is not None else lambda _method, _code: None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return _rewrapped(
            handler,
            lambda behavior: self._wrap_unary(method, behavior),
            lambda behavior: self._wrap_stream(method, behavior),
        )

    def _wrap_unary(self, method: str, behavior: Callable[..., Awaitable]):
        count = self._count

        async def wrapped(request, context):
            started = time.perf_counter()
            budget_s = context.time_remaining()
            try:
                response = await behavior(request, context)
            except asyncio.CancelledError:
                count(method, ended_by_client(context, budget_s))
                raise
            except grpc.aio.AbortError:
                count(method, context.code() or grpc.StatusCode.UNKNOWN)
                raise
            except grpc.aio.InternalError:
                count(method, ended_by_client(context, budget_s))
                raise  # see _wrap_stream
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                count(method, _code_of(exc))
                await _abort_for(exc, method, request, context)
            count(method, grpc.StatusCode.OK)
            log.debug(
                "%s request_id=%s ok in %.1f ms",
                method,
                logged_request_id(request),
                (time.perf_counter() - started) * 1e3,
            )
            return response

        return wrapped

    def _wrap_stream(self, method: str, behavior: Callable[..., AsyncIterator]):
        if not inspect.isasyncgenfunction(behavior):
            return behavior
        count = self._count

        async def wrapped(request, context):
            budget_s = context.time_remaining()
            try:
                async for item in behavior(request, context):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):
                # GeneratorExit: the stream was closed at a yield, the client gone between
                # messages; counted as the handler's own metrics count it.
                count(method, ended_by_client(context, budget_s))
                raise
            except grpc.aio.AbortError:
                count(method, context.code() or grpc.StatusCode.UNKNOWN)
                raise
            except grpc.aio.InternalError:
                # grpcio's ExecuteBatchError: an operation on a call its client already
                # ended (headers sent just after a 1 ms deadline passed, before the
                # handler is cancelled); grpcio drops it for a closed call. Taken for a
                # server fault, it was logged with a traceback and counted INTERNAL.
                count(method, ended_by_client(context, budget_s))
                raise
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                count(method, _code_of(exc))
                await _abort_for(exc, method, request, context)
            count(method, grpc.StatusCode.OK)

        return wrapped


# What a request's bytes become when they are no message of the method's request type
# (garbage, a truncated message, a string field that is not UTF-8).
_UNDECODABLE = object()


def _tolerant(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    """``deserializer`` returning ``_UNDECODABLE`` where it raises: grpcio answers a
    deserializer's exception UNKNOWN with protobuf's text, and logs a traceback for each
    such call, before any check of the caller (a probe: anyone reaching a port could
    fill the logs)."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and kin
            return _UNDECODABLE

    return deserialize


def _refuse_undecodable(method: str, request: object) -> None:
    """Refuse a request whose bytes did not decode, and one whose request_id breaks the
    rule every RPC holds it to (the one place that checks it: some RPCs echoed a 1 MB
    id back, others refused it)."""
    if request is _UNDECODABLE:
        raise InvalidArgument(f"the request is not a valid message for {method}")
    check_request_id(getattr(request, "request_id", ""))


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    """The innermost interceptor: a request whose bytes do not decode, or whose
    request_id is not a valid one (``services.ids.check_request_id``), is refused
    INVALID_ARGUMENT, after the caller is authenticated (the interceptors outside it
    run first) and counted and logged as any refused call is (``ErrorInterceptor``)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is None and not inspect.isasyncgenfunction(handler.unary_stream):
            return handler  # a stream of requests, or a stream this cannot wrap: as it is

        def unary(behavior):
            async def checked(request, context):
                _refuse_undecodable(method, request)
                return await behavior(request, context)

            return checked

        def stream(behavior):
            async def checked(request, context):
                _refuse_undecodable(method, request)
                async for item in behavior(request, context):
                    yield item

            return checked

        return _rewrapped(handler, unary, stream, _tolerant)


def _rewrapped(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Callable], Callable],
    stream: Callable[[Callable], Callable],
    deserializer: Callable[[Callable | None], Callable | None] = lambda d: d,
) -> grpc.RpcMethodHandler:
    """``handler`` with its unary or server-streaming behaviour passed through ``unary``
    or ``stream`` and its request deserializer through ``deserializer``; a handler of
    another kind as it is."""
    if handler.unary_unary is not None:
        make, behavior = grpc.unary_unary_rpc_method_handler, unary(handler.unary_unary)
    elif handler.unary_stream is not None:
        make, behavior = grpc.unary_stream_rpc_method_handler, stream(handler.unary_stream)
    else:
        return handler
    return make(
        behavior,
        request_deserializer=deserializer(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


class HealthServicer(health_aio.HealthServicer):
    """grpcio-health-checking's servicer with List, which it leaves unimplemented (an
    exception, so INTERNAL and a logged traceback on every call)."""

    def __init__(self) -> None:
        super().__init__()
        self._services = {""}  # the server's overall health, set by the library itself

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        self._services.add(service)
        await super().set(service, status)

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        """Each service :meth:`set` named, with what Check answers for it."""
        return health_pb2.HealthListResponse(
            statuses={
                name: await self.Check(health_pb2.HealthCheckRequest(service=name), context)
                for name in sorted(self._services)
            }
        )


@dataclass
class ServiceBinding:
    """A servicer and the generated function that adds it to a server."""

    servicer: object
    add_to_server: Callable[[object, grpc.aio.Server], None]
    full_name: str  # e.g. "iserve.v1.ModelService"


@dataclass(frozen=True)
class ServerSecurity:
    """How a server listens (plaintext or TLS) and who may call it."""

    transport: Transport = Transport()
    # Resolves bearer tokens; None: every call is let in (authentication off).
    authenticator: Authenticator | None = None


async def start_server(
    bindings: Iterable[ServiceBinding],
    address: str,
    metrics: RpcMetrics | None = None,
    security: ServerSecurity | None = None,
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Start a server on ``address`` (port 0 picks a free port); returns it and its port.
    With ``metrics``, every call is counted by method and status code; ``security``
    (default: plaintext, open) sets TLS and the access policy."""
    bindings = list(bindings)
    security = security or ServerSecurity()
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor(metrics)]
    if security.authenticator is not None:
        interceptors.append(AuthInterceptor(security.authenticator))
    interceptors.append(DecodeInterceptor())
    server = grpc.aio.server(interceptors=interceptors, options=CHANNEL_OPTIONS)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [b.full_name for b in bindings]
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    port = security.transport.add_port(server, address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


async def run_server(
    name: str,
    bindings: Iterable[ServiceBinding],
    address: str,
    *,
    on_started: Callable[[int], Awaitable[None] | None] | None = None,
    background: Iterable[Callable[[], Awaitable[None]]] = (),
    on_stop: Callable[[], Awaitable[None]] | None = None,
    before_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
    drain: Drain | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    metrics: RpcMetrics | None = None,
    security: ServerSecurity | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, running ``background`` coroutines alongside.

    On a signal: health turns NOT_SERVING; with ``drain``, ``drain(drain_timeout_s)``
    runs while the server still listens (it refuses new calls and waits for those in
    flight; a second signal cuts it short); background tasks are cancelled; the server
    stops, giving calls in flight ``grace_s`` seconds, or none after a drain (the drain
    was their grace); then ``on_stop`` runs, after the last call, so no call sees what
    it closes. ``before_stop`` runs once the background tasks are cancelled and before
    the server stops: what a service tells others of its stop before it stops answering.
    """
    server, port, health_servicer = await start_server(bindings, address, metrics, security)
    if security is not None:
        tls = security.transport.tls is not None and security.transport.tls.serves
        log.info(
            "%s listening on %s (port %d, %s, authentication %s)",
            name,
            address,
            port,
            "TLS" if tls else "plaintext",
            "on" if security.authenticator is not None else "OFF",
        )
        if security.authenticator is None:
            log.warning(
                "AUTHENTICATION IS OFF: anything that reaches %s may call every RPC of %s "
                "(set ISERVE_AUTH=on; docs/security.md)",
                address,
                name,
            )
    else:
        log.info("%s listening on %s (port %d)", name, address, port)
    if on_started is not None:
        result = on_started(port)
        if inspect.isawaitable(result):
            await result
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # The signal that stopped it, for the log: an operator's kill and `iserve down` read
    # the same "stopping" otherwise (a probe).
    received: list[str] = []

    def stop_on(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop_on, sig)
    tasks = [asyncio.create_task(make(), name=f"{name}:{make.__name__}") for make in background]
    for task in tasks:
        task.add_done_callback(_log_task_death)
    await stop.wait()
    log.info("%s stopping (%s received)", name, received[0] if received else "stop")
    await health_servicer.enter_graceful_shutdown()
    if drain is not None:
        stop.clear()
        await _drain_unless_signalled(drain, drain_timeout_s, stop)
    # What is left takes seconds (grace_s and on_stop); should it hang, the log says
    # where: every asyncio task's stack, and (should the loop itself be blocked) every
    # thread's, which faulthandler writes to stderr.
    faulthandler.dump_traceback_later(grace_s + STOP_STACKS_AFTER_S, exit=False)
    watchdog = loop.call_later(grace_s + STOP_STACKS_AFTER_S, _log_tasks, name)
    await cancel_and_wait(tasks)
    if before_stop is not None:
        await before_stop()
    await server.stop(0 if drain is not None else grace_s)
    if on_stop is not None:
        await on_stop()
    faulthandler.cancel_dump_traceback_later()
    watchdog.cancel()
    log.info("%s stopped", name)


def _log_tasks(name: str) -> None:
    """Log where each asyncio task waits: its chain of awaited coroutines, outermost
    first (a task's own stack shows only its outermost frame)."""
    for task in asyncio.all_tasks():
        where, coro = [], task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                where.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        log.warning(
            "%s still stopping; task %s waits at:\n%s", name, task.get_name(), "\n".join(where)
        )


async def _drain_unless_signalled(drain: Drain, timeout_s: float, signalled: asyncio.Event) -> None:
    """Run ``drain(timeout_s)`` until it returns or ``signalled`` is set."""
    draining = asyncio.create_task(drain(timeout_s))
    second_signal = asyncio.create_task(signalled.wait())
    await asyncio.wait({draining, second_signal}, return_when=asyncio.FIRST_COMPLETED)
    if second_signal.done():
        log.warning("second signal: stopping without waiting for the calls in flight")
    await cancel_and_wait((draining, second_signal))


def _log_task_death(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died", task.get_name(), exc_info=task.exception())


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
    )


# A line configure_logging writes at DEBUG or INFO: its format's asctime and levelname.
_ROUTINE_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:DEBUG|INFO) ")


def is_routine_record(line: str) -> bool:
    """Whether a log line is one of configure_logging's DEBUG or INFO records (what an
    agent leaves out when it quotes why a worker died)."""
    return _ROUTINE_RECORD.match(line) is not None


def channel(address: str) -> grpc.aio.Channel:
    """An aio channel to ``address`` with iserve's message limits, this process's TLS
    settings and its bearer token (:mod:`services.transport`)."""
    return transport.current().aio_channel(address)
