"""Every service's ``python -m`` entry point takes no arguments: ``--help`` says what
configures it, and an argument is a usage error. Before, both were ignored: ``--help``
started the service (the gateway served on 127.0.0.1:8000 with authentication off)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

MODULES = [
    "fingerprint_svc",
    "estimator_svc",
    "deploy_svc",
    "scheduler_svc",
    "monitor_agent",
    "gateway_svc",
]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("ISERVE_")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("module", MODULES)
def test_help_says_what_configures_it_and_starts_nothing(module):
    shown = _run(module, "--help")
    assert shown.returncode == 0, shown.stderr
    assert f"usage: python -m {module}" in shown.stdout
    assert "ISERVE_* variables and REDIS_URL configure it" in shown.stdout


@pytest.mark.parametrize("module", ["scheduler_svc", "gateway_svc"])
def test_an_argument_is_a_usage_error(module):
    refused = _run(module, "--port", "9000")
    assert refused.returncode == 2
    assert "unrecognized arguments: --port 9000" in refused.stderr


@pytest.mark.parametrize("module", ["scheduler_svc", "gateway_svc"])
def test_settings_that_do_not_load_stop_it_with_their_reason(module, tmp_path):
    # The gateway printed a traceback before; both now say what is wrong, status 2.
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("ISERVE_")}
    env["ISERVE_STATE_DIR"] = str(tmp_path)
    env["ISERVE_LOG_LEVEL"] = "loud"
    out = subprocess.run(
        [sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: ISERVE_LOG_LEVEL must be one of"), out.stderr
    assert "Traceback" not in out.stderr
