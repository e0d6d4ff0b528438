"""`iserve up --detach` and `iserve down` as a user runs them: separate processes, the
CLI's own transport (set up before `up` writes the stack's tokens)."""

from __future__ import annotations

import os

import pytest

from services.ports import free_port
from services.settings import GATEWAY_ENV, METRICS_ENV, SERVICE_ENV
from tests.integration.helpers import run_cli

pytestmark = pytest.mark.integration


def test_up_with_authentication_on_starts_and_down_stops(tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")},
        "ISERVE_AUTH": "on",
        "ISERVE_STATE_DIR": str(tmp_path / "state"),
        "ISERVE_DEVICES": "1",
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
        **{var: f"127.0.0.1:{free_port()}" for var in METRICS_ENV.values()},
        GATEWAY_ENV: f"127.0.0.1:{free_port()}",
    }
    env.pop("REDIS_URL", None)
    try:
        up = run_cli(env, "up", "--detach")
        # It lists the deployments kept from before with the admin token it just wrote
        # (an UNAUTHENTICATED error before).
        assert up.returncode == 0, up.stderr
        assert "iserve is up" in up.stdout and "could not list" not in up.stdout, up.stdout
        status = run_cli(env, "status", "--json")
        assert status.returncode == 0, status.stderr
    finally:
        down = run_cli(env, "down")
    assert down.returncode == 0 and "stopped" in down.stdout, down.stderr
