"""``GET /ready``: the gateway is ready while the scheduler answers SERVING, and says
which service behind it does not; ``GET /health`` only says the process answers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx
import pytest

from services.health import wait_http
from services.ports import free_port
from services.settings import GATEWAY_ENV, SERVICE_ENV

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def gateway_with(stack, **addresses: str):
    """A gateway of its own on the stack's settings, with ``addresses`` (service name ->
    host:port) in place of the stack's."""
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, **stack.env, GATEWAY_ENV: address}
    env.update({SERVICE_ENV[name]: where for name, where in addresses.items()})
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway_svc"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_http(f"http://{address}/health", time.monotonic() + 60, proc)
        yield f"http://{address}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_stacks_gateway_is_ready(stack):
    reply = httpx.get(f"http://{stack.settings.gateway_address}/ready", timeout=10)
    assert reply.status_code == 200
    assert reply.json() == {
        "status": "ready",
        "services": {"scheduler": "SERVING", "deploy": "SERVING", "model": "SERVING"},
    }


def test_no_scheduler_is_not_ready_though_the_process_is_alive(stack):
    nowhere = f"127.0.0.1:{free_port()}"
    with gateway_with(stack, scheduler=nowhere) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        reply = httpx.get(f"{url}/ready", timeout=10)
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    assert reply.json() == {
        "status": "unavailable",
        "services": {"scheduler": "UNREACHABLE", "deploy": "SERVING", "model": "SERVING"},
    }


def test_no_model_service_leaves_it_ready_but_degraded(stack):
    nowhere = f"127.0.0.1:{free_port()}"
    with gateway_with(stack, model=nowhere) as url:
        reply = httpx.get(f"{url}/ready", timeout=10)
    assert reply.status_code == 200
    assert reply.json() == {
        "status": "degraded",
        "services": {"scheduler": "SERVING", "deploy": "SERVING", "model": "UNREACHABLE"},
    }
