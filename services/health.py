"""Health checks: gRPC health for the services and workers (the CLI, the launcher, the
deployer's worker checks, the gateway's readiness, tests), an HTTP 200 for the gateway,
and whether a port speaks TLS (to tell a plaintext client so)."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import transport


async def serving_status(channel: grpc.aio.Channel, timeout_s: float) -> str:
    """The gRPC health status the server behind ``channel`` answers (``SERVING``,
    ``NOT_SERVING`` while it drains, ...), or ``UNREACHABLE``."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s
        )
    except grpc.RpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def check(address: str, timeout_s: float = 2.0, service: str = "") -> bool:
    """True when ``address`` answers SERVING within ``timeout_s``."""
    with transport.sync_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``url`` answers 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError, http.client.HTTPException):
        # HTTPException: whatever answered does not speak HTTP. Seen once at start-up: the
        # probe's own source port drawn equal to the gateway's, so it connected to itself
        # and read its request back (BadStatusLine, a traceback out of `iserve up`).
        return False


def speaks_tls(address: str, timeout_s: float = 1.0) -> bool:
    """Whether the server at ``address`` ("host:port") completes a TLS handshake (its
    certificate not checked: only whether it speaks TLS, to say so to a client that
    does not). With mutual TLS, a client without a certificate completes its side of a
    TLS 1.3 handshake before the server refuses it."""
    host, _, port = address.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection(
                (host.strip("[]") or "127.0.0.1", int(port)), timeout_s
            ) as raw,
            context.wrap_socket(raw) as tls,
        ):
            return tls.version() is not None
    except (OSError, ValueError):
        return False


def wait_serving(address: str, deadline: float, proc: subprocess.Popen | None = None) -> bool:
    """Poll until ``address`` is SERVING, ``proc`` exits, or ``time.monotonic()`` passes
    ``deadline``."""
    return _wait(lambda: check(address, timeout_s=0.5), deadline, proc)


def wait_http(url: str, deadline: float, proc: subprocess.Popen | None = None) -> bool:
    """Poll until ``url`` answers 200, ``proc`` exits, or ``deadline`` passes."""
    return _wait(lambda: http_ok(url, timeout_s=1.0), deadline, proc)


def _wait(probe: Callable[[], bool], deadline: float, proc: subprocess.Popen | None) -> bool:
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if probe():
            return True
        time.sleep(0.1)
    return False
