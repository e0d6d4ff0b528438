"""``GET /ready``: the gateway is ready while the scheduler answers SERVING, and says
which service behind it does not; ``GET /health`` only says the process answers."""

from __future__ import annotations

import httpx
import pytest

from services.ports import free_port
from services.settings import SERVICE_ENV
from tests.integration.helpers import own_gateway

pytestmark = pytest.mark.integration

ALL_SERVING = {"scheduler": "SERVING", "deploy": "SERVING", "model": "SERVING"}


def test_the_stacks_gateway_is_ready(stack):
    reply = httpx.get(f"http://{stack.settings.gateway_address}/ready", timeout=10)
    assert reply.status_code == 200
    assert reply.json() == {"status": "ready", "services": ALL_SERVING}


@pytest.mark.parametrize(
    ("gone", "status", "said"),
    [
        # Every generation goes through the scheduler: not ready, though alive.
        ("scheduler", 503, "unavailable"),
        # Generations still work without the model service: ready, degraded.
        ("model", 200, "degraded"),
    ],
)
def test_a_service_out_of_reach_is_named(stack, gone, status, said):
    nowhere = f"127.0.0.1:{free_port()}"
    with own_gateway(stack, {SERVICE_ENV[gone]: nowhere}) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        reply = httpx.get(f"{url}/ready", timeout=10)
    assert reply.status_code == status
    assert reply.json() == {"status": said, "services": {**ALL_SERVING, gone: "UNREACHABLE"}}
    if status == 503:
        assert reply.headers["retry-after"] == "1"
