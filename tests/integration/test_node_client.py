"""clients/node against the live stack: register, deploy, stream, timings, remove.

Needs ``node`` and ``npm`` (skipped with the reason where either is absent); the client's
dependencies are installed from its committed package-lock.json with ``npm ci``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from services.api import deployment_service_pb2 as deploy_pb
from services.ports import free_port
from tests.integration.helpers import interrupted_once_deployed, make_checkpoint

pytestmark = pytest.mark.integration

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"


@pytest.fixture(scope="module")
def node_client():
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the Node client (apt-get install nodejs npm)")
    lock = CLIENT / "package-lock.json"
    installed = CLIENT / "node_modules" / ".package-lock.json"
    if not installed.is_file() or installed.stat().st_mtime < lock.stat().st_mtime:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT, check=True, timeout=300)
    return node


def test_the_node_client_registers_deploys_and_streams_with_timings(stack, node_client):
    checkpoint = make_checkpoint(stack, "node-llama")
    env = {**os.environ, **stack.env}
    run = subprocess.run(
        [
            node_client,
            str(CLIENT / "demo.js"),
            "node-llama",
            checkpoint,
            "hello",
            "--max-tokens",
            "8",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr + run.stdout
    out = run.stdout
    assert "registered node-llama" in out
    deployed = re.search(r"deployed (\S+) on \S+:\d+", out)
    assert deployed, out
    timings = re.search(
        r"\[8 tokens, FINISH_REASON_LENGTH; queue [\d.]+ ms, TTFT ([\d.]+) ms, TPOT ([\d.]+) ms",
        out,
    )
    assert timings and float(timings[1]) > 0 and float(timings[2]) > 0, out
    assert f"removed {deployed[1]}" in out
    gone = stack.deployments.ListDeployments(
        deploy_pb.ListDeploymentsRequest(model_id="node-llama")
    )
    assert all(d.state != deploy_pb.DEPLOYMENT_STATE_READY for d in gone.deployments)

    # A bad request is a clear error and a non-zero exit, not a hang.
    def demo(*args: str, env: dict[str, str] = env) -> subprocess.CompletedProcess:
        command = [node_client, str(CLIENT / "demo.js"), *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    bad = demo("no-such-model", "no/such/dir")
    assert bad.returncode == 1 and "RegisterModel: " in bad.stderr, bad.stderr
    # A --max-tokens the request cannot carry is a usage error before any call (2.7 was
    # cut to 2, and 2^32 + 1 wrapped to 1 after a deploy).
    for value in ("2.7", "4294967297", "0", "x"):
        command = [node_client, str(CLIENT / "demo.js"), "m", "d", "--max-tokens", value]
        bad = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "--max-tokens must be a whole number" in bad.stderr
        assert "RegisterModel" not in bad.stderr
    # A mistyped flag is a usage error: it became the prompt, and 24 tokens were made.
    bad = demo("m", "d", "--max-token", "3")
    assert bad.returncode == 2 and "unknown option --max-token" in bad.stderr, bad.stderr
    # A model registered from another checkpoint is refused: it deployed and served that
    # one, exiting 0.
    elsewhere = make_checkpoint(stack, "node-elsewhere")
    bad = demo("node-llama", elsewhere)
    assert bad.returncode == 1, bad.stderr + bad.stdout
    assert (
        f'model node-llama is registered from checkpoint "{checkpoint}", not "{elsewhere}"'
        in bad.stderr
    ), bad.stderr
    assert "deployed" not in bad.stdout

    # Ctrl-C mid-stream still removes the deployment (Node's default exit skipped it).
    interrupted, deployment_id, out, err = interrupted_once_deployed(
        [node_client, str(CLIENT / "demo.js"), "node-llama", checkpoint, "--max-tokens", "250"],
        env,
        signal.SIGINT,
    )
    assert interrupted.returncode == 130, err + out
    assert f"removed {deployment_id}" in out and "stopped by SIGINT" in err, err + out
    left = stack.deployments.ListDeployments(
        deploy_pb.ListDeploymentsRequest(model_id="node-llama")
    )
    assert all(d.state != deploy_pb.DEPLOYMENT_STATE_READY for d in left.deployments)

    # A stack that is not there: the status and gRPC's words, no dangling "Resolution
    # note: " grpc-js leaves at their end.
    nowhere = {**env, "ISERVE_MODEL_ADDR": f"127.0.0.1:{free_port()}"}
    down = demo("m", "d", env=nowhere)
    assert down.returncode == 1 and "RegisterModel: UNAVAILABLE: " in down.stderr, down.stderr
    assert "(is the stack up? `iserve status` says)" in down.stderr, down.stderr
    assert not down.stderr.rstrip().endswith("Resolution note:"), down.stderr


def test_the_node_client_finds_the_stack_as_the_cli_does(stack, node_client):
    """Without ISERVE_*_ADDR, the addresses `iserve up` recorded in stack.json (here
    its free ports), as the Python CLI finds them: the client called the default ports
    before, another stack's if one ran there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
    env["ISERVE_STATE_DIR"] = stack.env["ISERVE_STATE_DIR"]
    script = (
        'const { connect, unary } = require("./iserve");'
        '(async () => { const r = await unary(connect().deployments, "GetClusterState", {});'
        " console.log(JSON.stringify(r.nodes.map((n) => n.node_id))); })()"
        ".catch((e) => { console.error(e.message); process.exit(1); });"
    )
    run = subprocess.run(
        [node_client, "-e", script], cwd=CLIENT, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    cluster = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    assert run.stdout.strip() == json.dumps(
        [n.node_id for n in cluster.nodes], separators=(",", ":")
    )


@pytest.mark.parametrize(
    ("token", "said"),
    [
        ("abc\u00e9" * 8, "ISERVE_TOKEN: a token is printable ASCII and has no spaces"),
        ("a" * 20 + "\nmore-of-it", "ISERVE_TOKEN: a token is printable ASCII and has no spaces"),
        ("short", "ISERVE_TOKEN: a token is 24-512 characters"),
    ],
)
def test_the_node_client_refuses_a_token_grpc_cannot_carry(node_client, tmp_path, token, said):
    """A token grpc-js cannot put in metadata (not ASCII, a newline) threw from inside the
    call with grpc-js's own message, crashing a streaming caller; connect() now says what
    is wrong with ISERVE_TOKEN, as the Python CLI does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
    env.update(ISERVE_STATE_DIR=str(tmp_path), ISERVE_TOKEN=token)
    script = (
        'try { require("./iserve").connect(); console.log("connected"); }'
        " catch (e) { console.error(e.message); process.exit(2); }"
    )
    run = subprocess.run(
        [node_client, "-e", script], cwd=CLIENT, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2, run.stdout
    assert run.stderr.strip() == said


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        (
            {"ISERVE_MODEL_ADDR": "garbage"},
            'ISERVE_MODEL_ADDR="garbage": not host:port (a port from 1 to 65535)',
        ),
        (
            {"ISERVE_MODEL_ADDR": "127.0.0.1:99999"},
            'ISERVE_MODEL_ADDR="127.0.0.1:99999": not host:port (a port from 1 to 65535)',
        ),
        (
            {"ISERVE_TLS_CA": "/nonexistent/ca.pem"},
            "ISERVE_TLS_CA: cannot read /nonexistent/ca.pem: ENOENT",
        ),
        (
            {"ISERVE_PROTOS": "/nonexistent"},
            "no iserve protos under /nonexistent: set ISERVE_PROTOS to the repository's protos/ folder",
        ),
    ],
)
def test_the_node_client_names_the_setting_it_cannot_use(node_client, tmp_path, setting, said):
    """grpc-js's words named none of them ("Name resolution failed for target
    dns:garbage", a bare ENOENT, a proto-loader warning): the client says which variable
    to fix, as the Python CLI does (a tester)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
    env.update(ISERVE_STATE_DIR=str(tmp_path), **setting)
    script = (
        'try { require("./iserve").connect().models.getChannel(); console.log("connected"); }'
        " catch (e) { console.error(e.message); process.exit(2); }"
    )
    run = subprocess.run(
        [node_client, "-e", script], cwd=CLIENT, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == said
