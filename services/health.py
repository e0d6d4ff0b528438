"""gRPC health checks used by the CLI, the launcher and tests."""

from __future__ import annotations

import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, timeout_s: float = 2.0, service: str = "") -> bool:
    """True when ``address`` answers SERVING within ``timeout_s``."""
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(address: str, deadline: float, proc: subprocess.Popen | None = None) -> bool:
    """Poll until ``address`` is SERVING, ``proc`` exits, or ``time.monotonic()`` passes
    ``deadline``."""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if check(address, timeout_s=0.5):
            return True
        time.sleep(0.1)
    return False
