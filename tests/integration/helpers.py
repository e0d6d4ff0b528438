"""Small helpers for integration tests against the real stack."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.health import wait_http
from services.models.checkpoint import create_checkpoint
from services.ports import free_port
from services.settings import GATEWAY_ENV

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def rid() -> str:
    return uuid.uuid4().hex[:12]


def make_checkpoint(stack, name: str, **shape) -> str:
    """Write a small checkpoint under the stack's models root; returns its relative path."""
    create_checkpoint(stack.models_root / name, **{**TINY, **shape}, overwrite=True)
    return name


def register(stack, model_id: str, checkpoint: str) -> model_pb.Model:
    return stack.models.RegisterModel(
        model_pb.RegisterModelRequest(
            request_id=rid(), model_id=model_id, checkpoint_path=checkpoint, skip_profiling=True
        )
    ).model


def deploy(stack, model_id: str, **fields) -> deploy_pb.DeployResponse:
    fields.setdefault("config", common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1))
    fields.setdefault("request_id", rid())
    return stack.deployments.Deploy(
        deploy_pb.DeployRequest(model_id=model_id, **fields), timeout=180
    )


def remove_deployments_of(stack, model_id: str) -> None:
    """Remove every deployment of ``model_id`` (a test's cleanup)."""
    listed = stack.deployments.ListDeployments(deploy_pb.ListDeploymentsRequest(model_id=model_id))
    for dep in listed.deployments:
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
        )


def reserved_by_device(stack) -> dict[str, int]:
    state = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    return {
        f"{d.ref.node_id}/{d.ref.device_id}": d.reserved_bytes
        for n in state.nodes
        for d in n.devices
    }


def generate(
    stack, timeout: float = 60, **fields
) -> tuple[list[infer_pb.TokenDelta], infer_pb.GenerateFinal]:
    fields.setdefault("request_id", rid())
    deltas, final = [], None
    for message in stack.inference.Generate(infer_pb.GenerateRequest(**fields), timeout=timeout):
        if message.HasField("delta"):
            deltas.append(message.delta)
        else:
            final = message.final
    assert final is not None, "stream ended without a final message"
    return deltas, final


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def run_cli(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``iserve ARGS`` as a separate process with exactly ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_on_terminal(stack, *args: str, timeout: float = 180) -> tuple[int, str, str]:
    """``iserve ARGS`` with its stderr on a pseudo-terminal, where the CLI draws its
    status lines: (exit code, stdout, what the terminal received)."""
    import pty
    import threading

    master, slave = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", *args],
        env={**os.environ, **stack.env, "TERM": "xterm", "COLUMNS": "200"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    received = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):  # EIO once the child's end is closed
            while chunk := os.read(master, 4096):
                received.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        process.kill()
        reader.join(timeout=10)
        os.close(master)
    return process.returncode, out.decode(), received.decode(errors="replace")


def cli(stack, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_cli({**os.environ, **stack.env}, *args, timeout=timeout)


async def _with_store(redis_url: str, action):
    from services.state.store import StateStore

    store = StateStore.from_url(redis_url)
    try:
        return await action(store)
    finally:
        await store.close()


def with_store(stack, action):
    """Run ``action(store)`` (a coroutine) against the stack's Redis; returns its result."""
    return asyncio.run(_with_store(stack.redis_url, action))


def forget_models(stack, model_ids: list[str], hardware_type: str) -> None:
    """Delete the models and their configuration maps on ``hardware_type``."""
    from services.state import keys

    async def forget(store) -> None:
        for model_id in model_ids:
            await store.delete_model(model_id)
            await store.redis.delete(keys.config_map(model_id, hardware_type))

    with_store(stack, forget)


def live_devices(stack) -> list[common.DeviceState]:
    """Every device of the stack's live nodes, by device id."""
    state = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    return sorted(
        (d for n in state.nodes if n.alive for d in n.devices), key=lambda d: d.ref.device_id
    )


def settled_devices(stack, timeout_s: float = 15.0) -> list[common.DeviceState]:
    """``live_devices`` once every device's state was published after this call, so its
    measured use no longer counts workers that an earlier test has just stopped."""
    since_ms = int(time.time() * 1000)
    deadline = time.monotonic() + timeout_s
    while True:
        devices = live_devices(stack)
        if all(d.updated_at_unix_ms > since_ms for d in devices):
            return devices
        if time.monotonic() > deadline:
            raise AssertionError(f"device states not republished within {timeout_s} s")
        time.sleep(0.1)


@contextlib.contextmanager
def own_gateway(stack, env: dict[str, str]):
    """A gateway process of its own, on a free port, with the stack's settings and ``env``
    over them; yields its base URL once /health answers, stops it after."""
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway_svc"],
        env={**os.environ, **stack.env, GATEWAY_ENV: address, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_http(f"http://{address}/health", time.monotonic() + 60, proc)
        yield f"http://{address}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def interrupted_once_deployed(command: list[str], env: dict[str, str], sig: int):
    """Run a client demo ``command`` and send it ``sig`` once it printed its "deployed
    ID on ADDRESS" line (with its first streamed text); returns (process, deployment id,
    stdout after that line, stderr)."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        while line and not line.startswith("deployed "):
            line = proc.stdout.readline()
        assert line, proc.stderr.read()
        proc.send_signal(sig)
        # Read through the stream readline used: communicate() reads the pipe itself,
        # and the text readline had buffered past its line was lost.
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc, line.split()[1], out, err
