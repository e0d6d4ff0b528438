"""The real agent process (``python -m monitor_agent``) over gRPC, with a real Redis."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import agent_service_pb2 as agent_pb
from services.api import agent_service_pb2_grpc, worker_service_pb2_grpc
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.models.checkpoint import create_checkpoint
from services.ports import free_port
from services.state.store import StateStore

NODE = "node-p"
GIB = 1 << 30


@pytest.fixture(scope="module")
def models_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    create_checkpoint(root / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return root


def _agent_env(state_dir: Path, models_root: Path, redis_url: str | None, node_id: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
    env.pop("REDIS_URL", None)
    env.update(
        ISERVE_STATE_DIR=str(state_dir),
        ISERVE_MODELS_ROOT=str(models_root),
        ISERVE_AGENT_ADDR=f"127.0.0.1:{free_port()}",
        ISERVE_AGENT_METRICS_ADDR="127.0.0.1:0",
        ISERVE_NODE_ID=node_id,
        ISERVE_DEVICES="2",
        ISERVE_DEVICE_MEMORY_GIB="1",
        ISERVE_HEARTBEAT_TTL_S="3",
    )
    if redis_url:
        env["REDIS_URL"] = redis_url
    return env


def _start_agent(env: dict, log_path: Path) -> subprocess.Popen:
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "monitor_agent"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    address = env["ISERVE_AGENT_ADDR"]
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc
            except grpc.RpcError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"agent did not start:\n{log_path.read_text()}")
            time.sleep(0.05)


def _stop_agent(proc: subprocess.Popen) -> int | None:
    """SIGTERM and its exit code; None when it has not exited within 20 s (then killed:
    the callers' assertions print its log, where a stop hanging past its grace has
    written every thread's stack)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return None


@pytest.fixture(scope="module")
def agent(redis_url, models_root, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("state")
    env = _agent_env(state_dir, models_root, redis_url, NODE)
    env["ISERVE_TOKEN"] = "a-client-token-no-worker-needs"
    proc = _start_agent(env, state_dir / "agent.log")
    with grpc.insecure_channel(env["ISERVE_AGENT_ADDR"]) as channel:
        yield agent_service_pb2_grpc.AgentServiceStub(channel), env
    assert _stop_agent(proc) == 0, (state_dir / "agent.log").read_text()


def _nodes(redis_url: str) -> dict[str, common.NodeState]:
    async def read():
        store = StateStore.from_url(redis_url)
        try:
            return {n.node_id: n for n in await store.list_nodes()}
        finally:
            await store.close()

    return asyncio.run(read())


def _start_request(deployment_id: str, **changes) -> agent_pb.StartWorkersRequest:
    request = agent_pb.StartWorkersRequest(
        request_id=f"start-{deployment_id}",
        deployment_id=deployment_id,
        checkpoint_path="tiny",
        config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
        workers=[agent_pb.WorkerSpec(rank=0, device_id="cpu0")],
        max_seq_len=256,
        engine=agent_pb.ENGINE_KIND_PYTORCH,
        ready_timeout_ms=60_000,
    )
    for name, value in changes.items():
        setattr(request, name, value)
    return request


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_node_registers_its_virtual_devices(agent, redis_url):
    stub, env = agent
    node = _nodes(redis_url)[NODE]
    assert node.alive and node.agent_address == env["ISERVE_AGENT_ADDR"]
    assert [d.ref.device_id for d in node.devices] == ["cpu0", "cpu1"]
    for device in node.devices:
        assert device.kind == common.DEVICE_KIND_CPU_VIRTUAL
        assert device.total_bytes == GIB
        assert device.hardware_type == f"cpu-{platform.machine()}"
        assert len(device.cpu_cores) >= 1
        assert device.updated_at_unix_ms > 0


def test_workers_start_serve_show_up_and_stop(agent, redis_url):
    stub, _env = agent
    reply = stub.StartWorkers(_start_request("dep-a"), timeout=90)
    assert reply.request_id == "start-dep-a"
    [worker] = reply.workers
    assert worker.state == agent_pb.WORKER_STATE_READY and _alive(worker.pid)
    # Redis's URL (its password) and client tokens stay with the agent: neither the worker
    # nor the fork server it came from has them, in os.environ or in /proc (a worker's
    # first environment there is the fork server's).
    if sys.platform == "linux":
        parent = psutil.Process(worker.pid).parent()
        for pid in (worker.pid, parent.pid):
            names = {
                e.split(b"=", 1)[0] for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            }
            assert not names & {b"REDIS_URL", b"ISERVE_TOKEN"}, (pid, names)

    listed = stub.ListWorkers(agent_pb.ListWorkersRequest(deployment_id="dep-a"), timeout=10)
    assert [w.address for w in listed.workers] == [worker.address]
    assert (
        stub.ListWorkers(agent_pb.ListWorkersRequest(deployment_id="x"), timeout=10).workers == []
    )

    with grpc.insecure_channel(worker.address) as channel:
        worker_stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb.WorkerServiceGenerateRequest(
            prompt="Hello", max_tokens=200, sampling=common.SamplingParams(ignore_eos=True)
        )
        assert len(list(worker_stub.Generate(request, timeout=60))) == 200

    # The monitor attributes the worker's memory and busy time to its device.
    deadline = time.monotonic() + 5
    while True:
        cpu0 = _nodes(redis_url)[NODE].devices[0]
        if cpu0.used_bytes > 0 and cpu0.load > 0:
            break
        assert time.monotonic() < deadline, f"device state never moved: {cpu0}"
        time.sleep(0.2)
    assert cpu0.used_bytes >= worker.resident_bytes

    stopped = stub.StopWorkers(agent_pb.StopWorkersRequest(deployment_id="dep-a"), timeout=30)
    assert [w.state for w in stopped.workers] == [agent_pb.WORKER_STATE_STOPPED]
    assert not _alive(worker.pid)
    again = stub.StopWorkers(agent_pb.StopWorkersRequest(deployment_id="dep-a"), timeout=30)
    assert list(again.workers) == []


@pytest.mark.parametrize(
    ("changes", "code", "message"),
    [
        (
            {"workers": [agent_pb.WorkerSpec(rank=0, device_id="cuda7")]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "device 'cuda7' is not on this node",
        ),
        ({"checkpoint_path": "../.."}, grpc.StatusCode.INVALID_ARGUMENT, "outside the models root"),
        ({"deployment_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "invalid deployment_id ''"),
        # A worker started for it refused it and exited: FAILED_PRECONDITION (a tester).
        (
            {"max_seq_len": 2**32 - 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_seq_len 4294967295 (the longest prompt + output a sequence holds) exceeds",
        ),
        (
            {"engine": agent_pb.ENGINE_KIND_TENSORRT_LLM},
            grpc.StatusCode.FAILED_PRECONDITION,
            "tensorrt_llm is not installed",
        ),
    ],
)
def test_bad_start_requests_get_clear_errors(agent, changes, code, message):
    stub, _env = agent
    request = _start_request("dep-bad")
    for name, value in changes.items():
        if name == "workers":
            del request.workers[:]
            request.workers.extend(value)
        else:
            setattr(request, name, value)
    with pytest.raises(grpc.RpcError) as caught:
        stub.StartWorkers(request, timeout=30)
    assert caught.value.code() == code
    assert message in caught.value.details()


def test_bad_profiling_requests_get_clear_errors(agent):
    stub, _env = agent
    with pytest.raises(grpc.RpcError) as caught:
        stub.RunProfilingJob(agent_pb.RunProfilingJobRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "input_tokens must be at least 1"


def test_stopping_the_agent_stops_its_workers(redis_url, models_root, tmp_path):
    env = _agent_env(tmp_path, models_root, redis_url, "node-shutdown")
    proc = _start_agent(env, tmp_path / "agent.log")
    try:
        with grpc.insecure_channel(env["ISERVE_AGENT_ADDR"]) as channel:
            stub = agent_service_pb2_grpc.AgentServiceStub(channel)
            [worker] = stub.StartWorkers(_start_request("dep-s"), timeout=90).workers
        assert _alive(worker.pid)
        assert _stop_agent(proc) == 0
        assert not _alive(worker.pid)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_agent_refuses_to_start_without_redis(models_root, tmp_path):
    env = _agent_env(tmp_path, models_root, None, "node-x")
    result = subprocess.run(
        [sys.executable, "-m", "monitor_agent"], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "REDIS_URL is not set" in result.stderr


def test_an_agent_on_every_interface_advertises_this_machines_name(
    redis_url, models_root, tmp_path
):
    # 0.0.0.0 means "here" to whoever dials it: a deployer on another host would dial
    # itself. Workers still bind ISERVE_HOST (127.0.0.1), which the agent warns of.
    env = _agent_env(tmp_path, models_root, redis_url, "node-wild")
    port = free_port()
    env["ISERVE_AGENT_ADDR"] = f"0.0.0.0:{port}"
    proc = _start_agent(env, tmp_path / "agent.log")
    try:
        node = _nodes(redis_url)["node-wild"]
        assert node.agent_address == f"{socket.gethostname()}:{port}"
    finally:
        assert _stop_agent(proc) == 0
    assert "its workers bind 127.0.0.1 (ISERVE_HOST)" in (tmp_path / "agent.log").read_text()


def test_an_agent_given_a_malformed_redis_url_says_so_in_one_line(models_root, tmp_path):
    env = _agent_env(tmp_path, models_root, "redis://:sekret@localhost:notaport/0", "node-x")
    result = subprocess.run(
        [sys.executable, "-m", "monitor_agent"], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "REDIS_URL='redis://***@localhost:notaport/0'" in result.stderr
    assert "Traceback" not in result.stderr and "sekret" not in result.stderr


def test_the_agent_does_not_import_torch():
    probe = "import sys, monitor_agent.agent; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1:not-a-port", "ISERVE_AGENT_METRICS_ADDR='127.0.0.1:not-a-port': not host:port"),
        ("busy", ""),
    ],
)
def test_a_metrics_address_that_cannot_be_served_stops_the_agent_with_its_name(
    redis_url, models_root, tmp_path, address, why
):
    env = _agent_env(tmp_path, models_root, redis_url, "node-m")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if address == "busy":
            address = f"127.0.0.1:{taken.getsockname()[1]}"
            why = f"cannot serve metrics on {address}"
        env["ISERVE_AGENT_METRICS_ADDR"] = address
        result = subprocess.run(
            [sys.executable, "-m", "monitor_agent"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert why in result.stderr and "ISERVE_AGENT_METRICS_ADDR" in result.stderr
