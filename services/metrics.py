"""Prometheus metrics every iserve process serves over HTTP.

Uses ``prometheus-client``, the library Prometheus itself maintains for Python: its
text format, registries and HTTP exporter are what every scraper expects, so nothing
here formats metrics by hand. Each process has one registry (not the library's global
one, so a test may build a servicer twice) holding the process collectors (resident
memory, CPU, open files, GC), the RPC counter below and the service's own metrics, and
serves it at ``http://<ISERVE_<S>_METRICS_ADDR>/metrics``.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    make_wsgi_app,
)

from services.settings import TlsFiles

log = logging.getLogger("iserve.metrics")

PREFIX = "iserve_"
CONNECTION_TIMEOUT_S = 30.0


def new_registry() -> CollectorRegistry:
    """A registry with the process, platform and GC collectors of this process."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def certificate_expiry(registry: CollectorRegistry, tls: TlsFiles | None) -> None:
    """``iserve_tls_certificate_expiry_timestamp_seconds``: when the certificate this
    process loaded at start (``ISERVE_TLS_CERT``) expires, as Unix time, so that an alert
    fires before its connections start failing (the process keeps the certificate it
    loaded: a renewed file takes a restart). Absent where the process presents none."""
    if tls is None or tls.expires_at is None:
        return
    Gauge(
        f"{PREFIX}tls_certificate_expiry_timestamp_seconds",
        "When the TLS certificate this process presents expires (Unix time)",
        registry=registry,
    ).set(tls.expires_at)


Guard = Callable[[str], bool]
"""Whether an ``Authorization`` header value may read the metrics."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    # Seconds a connection may stay silent (its TLS handshake included) before it is
    # dropped: each holds a thread.
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def _guarded(app, guard: Guard):
    def guarded(environ, start_response):
        if guard(environ.get("HTTP_AUTHORIZATION", "")):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="iserve"')],
        )
        return [b"iserve metrics need `Authorization: Bearer <admin or service token>`\n"]

    return guarded


def serve_metrics(
    address: str,
    registry: CollectorRegistry,
    *,
    guard: Guard | None = None,
    tls: TlsFiles | None = None,
) -> int:
    """Serve ``registry`` as Prometheus text at ``http(s)://address/metrics`` from a daemon
    thread; returns the port (``host:0`` picks a free one). ``guard`` (authentication on)
    decides from each request's ``Authorization`` header; ``tls`` with a certificate serves
    HTTPS (asking for a client certificate when ``tls.client_auth``). The app is
    prometheus-client's own WSGI exporter. OSError naming the address
    when it cannot be bound."""
    host, _, port = address.rpartition(":")
    app = make_wsgi_app(registry)
    if guard is not None:
        app = _guarded(app, guard)
    try:
        server = make_server(
            host or "127.0.0.1", int(port), app, server_class=_Server, handler_class=_Quiet
        )
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot serve metrics on {address}: {exc}") from exc
    scheme = "http"
    if tls is not None and tls.serves:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(tls.cert), str(tls.key))
        if tls.client_auth:  # as the gRPC servers: a certificate the cluster's CA signed
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(str(tls.ca))
        # The handshake then happens in the connection's own thread, on its first read,
        # not in accept(): there a client that never sends would block every scrape.
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
        scheme = "https"
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = server.server_address[1]
    log.info(
        "metrics on %s://%s:%d/metrics%s",
        scheme,
        host or "127.0.0.1",
        bound,
        " (bearer token required)" if guard is not None else "",
    )
    return bound


class RpcMetrics:
    """``iserve_grpc_server_handled_total{grpc_service, grpc_method, grpc_code}``: every
    RPC the process answered and its status (the name go-grpc-prometheus made familiar)."""

    def __init__(self, registry: CollectorRegistry):
        self.handled = Counter(
            f"{PREFIX}grpc_server_handled_total",
            "RPCs completed, by method and status code",
            ["grpc_service", "grpc_method", "grpc_code"],
            registry=registry,
        )

    def count(self, method: str, code: grpc.StatusCode) -> None:
        """One RPC ``method`` ("/package.Service/Method") ended with ``code``."""
        service, _, name = method.lstrip("/").rpartition("/")
        self.handled.labels(service, name, code.name).inc()
