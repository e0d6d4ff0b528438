"""clients/python against the live stack: register, deploy, stream, timings, remove."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.api import deployment_service_pb2 as deploy_pb
from tests.integration.helpers import make_checkpoint

pytestmark = pytest.mark.integration


PYTHON_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "python" / "demo.py"


def test_the_python_client_registers_deploys_streams_and_removes(stack):
    """clients/python/demo.py: the same steps on grpcio and the committed stubs, finding
    the stack through its stack.json as the CLI does."""
    checkpoint = make_checkpoint(stack, "py-llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
    env["ISERVE_STATE_DIR"] = stack.env["ISERVE_STATE_DIR"]
    env.pop("PYTHONPATH", None)  # it finds the checkpoint's stubs beside itself
    command = [sys.executable, str(PYTHON_CLIENT), "py-llama", checkpoint, "hello"]
    # An option before the prompt, as the Node demo takes it (it was "unrecognized").
    run = subprocess.run(
        [*command[:-1], "--max-tokens", "8", "hello"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr + run.stdout
    out = run.stdout
    assert "registered py-llama" in out
    deployed = re.search(r"deployed (\S+) on \S+:\d+", out)
    assert deployed, out
    assert re.search(r"\d+ prompt \+ 8 tokens: queue [\d.]+ ms, TTFT [\d.]+ ms", out), out
    assert f"removed {deployed[1]}" in out
    gone = stack.deployments.ListDeployments(deploy_pb.ListDeploymentsRequest(model_id="py-llama"))
    assert all(d.state != deploy_pb.DEPLOYMENT_STATE_READY for d in gone.deployments)
    # A bad request is a clear error and exit 1; a bad --max-tokens a usage error (2).
    bad = subprocess.run(
        [sys.executable, str(PYTHON_CLIENT), "no-such-model", "no/such/dir"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "error: INVALID_ARGUMENT: " in bad.stderr, bad.stderr
    bad = subprocess.run(
        [*command, "--max-tokens", "0"], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--max-tokens must be a whole number" in bad.stderr
    # TLS on: plaintext would fail as an unexplained UNAVAILABLE (a tester).
    tls = subprocess.run(
        command, env={**env, "ISERVE_TLS_CA": "ca.pem"}, capture_output=True, text=True, timeout=60
    )
    assert tls.returncode == 2 and "ISERVE_TLS_CA set: this demo speaks plaintext" in tls.stderr
    # The id registered from another checkpoint: it served that one (a probe).
    other = make_checkpoint(stack, "py-llama-other")
    mixed = subprocess.run(
        [sys.executable, str(PYTHON_CLIENT), "py-llama", other, "hello", "--max-tokens", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert mixed.returncode == 1, mixed.stdout + mixed.stderr
    assert f"model py-llama is registered from checkpoint '{checkpoint}', not '{other}'" in (
        mixed.stderr
    )
    assert "deployed" not in mixed.stdout


def test_the_python_client_removes_its_deployment_on_sigterm(stack):
    """SIGTERM (a process manager's stop) left the demo's deployment running; Ctrl-C did
    not (a tester). Both remove it, exit 130."""
    checkpoint = make_checkpoint(stack, "py-term")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
    env["ISERVE_STATE_DIR"] = stack.env["ISERVE_STATE_DIR"]
    demo = subprocess.Popen(
        [sys.executable, str(PYTHON_CLIENT), "py-term", checkpoint, "hello", "--max-tokens", "400"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        while not (lines and lines[-1].startswith("deployed ")):
            line = demo.stdout.readline()
            assert line, (lines, demo.stderr.read())
            lines.append(line)
        demo.send_signal(signal.SIGTERM)  # as it streams
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, (out, err)
    assert "stopped" in err and "removed py-term-" in out, (out, err)
    listed = stack.deployments.ListDeployments(deploy_pb.ListDeploymentsRequest(model_id="py-term"))
    assert all(d.state != deploy_pb.DEPLOYMENT_STATE_READY for d in listed.deployments)
