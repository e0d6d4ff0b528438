"""How iserve's processes and clients reach each other: plaintext or TLS channels whose
calls carry the caller's bearer token, and the credentials servers listen with.

One :class:`Transport` per process, from its settings (:func:`configure`; a process that
configures none, such as a test, gets a client's, read from the environment each time): ``ISERVE_TLS_*`` picks TLS (mutual with
``ISERVE_TLS_CLIENT_AUTH=on``), and the token is ``ISERVE_TOKEN`` for clients and the
service token for iserve's own processes. TLS uses gRPC's own credentials
(``grpc.ssl_server_credentials``, ``grpc.ssl_channel_credentials``); the token travels
as ``authorization: Bearer <token>`` metadata, added by a client interceptor so it works
over plaintext loopback as well as TLS.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from functools import cached_property

import grpc

from services.settings import Settings, TlsFiles, load_settings

MAX_MESSAGE_BYTES = 64 << 20
# HTTP/2 keepalive while calls are open: a peer that stops answering pings (a process
# hung or SIGSTOPped, a host gone without closing its sockets) fails its calls with
# UNAVAILABLE within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, instead of a stream that
# waits forever for its next token. Pings are sent however long no data flows (a long
# prefill, a request queued at its worker), and servers accept them that often.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 20_000
# A channel whose peer went away retries with growing pauses; gRPC's default cap of
# 120 s left a node's agent unreachable for 35-70 s after it came back from a one- or
# two-minute outage. Capped, a peer that is back is reached within seconds.
MAX_RECONNECT_BACKOFF_MS = 5_000


def channel_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int]]:
    """The options of every channel and server: message limits, keepalive pings every
    ``keepalive_time_ms`` while calls are open, and servers that accept pings twice that
    often. gRPC core ignores a name it does not know, so these are its own
    (grpc_types.h); the server's is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
    whose value is "grpc.http2.min_ping_interval_without_data_ms". With the macro's name
    there instead, servers kept their 5-minute minimum and ended any call idle for about
    40 s with GOAWAY "too_many_pings" (a registration waiting on profiling, the
    profiler's own calls to the agents)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # How long a ping may wait for its ack before the connection is closed: what
        # fails the calls to a hung peer (test_faults' SIGSTOPped worker).
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_time_ms // 2),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


CHANNEL_OPTIONS = channel_options()


def _read(path) -> bytes | None:
    return None if path is None else path.read_bytes()


@dataclass(frozen=True)
class _Pem:
    """The PEM bytes of a process's TLS files, read once."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


@dataclass(frozen=True)
class Transport:
    tls: TlsFiles | None = None
    # The bearer token calls carry ("" none).
    token: str = ""

    @classmethod
    def for_client(cls, settings: Settings) -> Transport:
        """A CLI's or client's: ``ISERVE_TOKEN`` (or the local stack's admin token)."""
        return cls(settings.tls, settings.token)

    @classmethod
    def for_service(cls, settings: Settings) -> Transport:
        """An iserve process's: the service token."""
        return cls(settings.tls, settings.service_token)

    @cached_property
    def _pem(self) -> _Pem:
        tls = self.tls or TlsFiles()
        return _Pem(_read(tls.cert), _read(tls.key), _read(tls.ca))

    # ---- servers ------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials to listen with; None for plaintext."""
        if self.tls is None or not self.tls.serves:
            return None
        pem = self._pem
        return grpc.ssl_server_credentials(
            [(pem.key, pem.cert)],
            root_certificates=pem.ca,
            require_client_auth=self.tls.client_auth,
        )

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        credentials = self.server_credentials()
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)

    # ---- clients ------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls is None:
            return None
        mutual = self.tls.client_auth and self.tls.serves
        pem = self._pem
        return grpc.ssl_channel_credentials(
            root_certificates=pem.ca,
            private_key=pem.key if mutual else None,
            certificate_chain=pem.cert if mutual else None,
        )

    def options(self) -> list[tuple[str, object]]:
        options = list(CHANNEL_OPTIONS)
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return options

    def aio_channel(
        self, address: str, *, token: str | None = None, own_connections: bool = False
    ) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to ``address`` whose calls carry ``token`` (default: the
        process's). ``own_connections``: the channel shares no connection (gRPC's
        subchannels, with their reconnect backoff) with other channels to the address,
        so a new one connects at once even while an older one waits out its backoff."""
        token = self.token if token is None else token
        interceptors = [kind(token) for kind in _AIO_BEARERS] if token else None
        options = self.options()
        if own_connections:
            options.append(("grpc.use_local_subchannel_pool", 1))
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(
            address, credentials, options=options, interceptors=interceptors
        )

    def sync_channel(self, address: str, *, token: str | None = None) -> grpc.Channel:
        """A blocking channel to ``address`` (the CLI's), calls carrying ``token``."""
        token = self.token if token is None else token
        credentials = self.channel_credentials()
        if credentials is None:
            channel = grpc.insecure_channel(address, options=self.options())
        else:
            channel = grpc.secure_channel(address, credentials, options=self.options())
        if token:
            channel = grpc.intercept_channel(channel, _SyncBearer(token))
        return channel


_process: Transport | None = None


def configure(transport: Transport | None) -> None:
    """Set this process's transport (services do at start, with their service token);
    None goes back to a client's from the environment."""
    global _process
    _process = transport


def current() -> Transport:
    """This process's transport: as configured, else a client's from the environment as
    it is now (a process that never configures one, such as a test, may change it)."""
    return _process if _process is not None else Transport.for_client(load_settings())


# ---- the bearer token on every call -------------------------------------------------
def _with_token(metadata, token: str) -> list[tuple[str, str]] | None:
    """``metadata`` with ``authorization: Bearer <token>`` added; None when it names a
    token already (the gateway's calls, forwarding its client's), which it keeps."""
    entries = list(metadata or ())
    if any(k == "authorization" for k, _ in entries):
        return None
    entries.append(("authorization", f"Bearer {token}"))
    return entries


class _AioBearer:
    def __init__(self, token: str):
        self.token = token

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = _with_token(d.metadata, self.token)
        if metadata is None:
            return d
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready
        )


# grpc.aio files each interceptor under one kind of call: one class per kind.
class _AioUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, call_details, request):
        return await continuation(self._details(call_details), request)


class _AioUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, call_details, request):
        return await continuation(self._details(call_details), request)


class _AioStreamUnary(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, call_details, request_iterator):
        return await continuation(self._details(call_details), request_iterator)


class _AioStreamStream(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, call_details, request_iterator):
        return await continuation(self._details(call_details), request_iterator)


_AIO_BEARERS = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str):
        self.token = token

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = _with_token(d.metadata, self.token)
        if metadata is None:
            return d
        return _Details(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def sync_channel(address: str) -> grpc.Channel:
    """A blocking channel to ``address`` with this process's TLS settings and token."""
    return current().sync_channel(address)
