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

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    start_http_server,
)

log = logging.getLogger("iserve.metrics")

PREFIX = "iserve_"


def new_registry() -> CollectorRegistry:
    """A registry with the process, platform and GC collectors of this process."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def serve_metrics(address: str, registry: CollectorRegistry) -> int:
    """Serve ``registry`` as Prometheus text at ``http://address/metrics`` from a daemon
    thread; returns the port (``host:0`` picks a free one). OSError naming the address
    when it cannot be bound."""
    host, _, port = address.rpartition(":")
    try:
        server, _thread = start_http_server(int(port), host or "127.0.0.1", registry)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot serve metrics on {address}: {exc}") from exc
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host or "127.0.0.1", bound)
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
