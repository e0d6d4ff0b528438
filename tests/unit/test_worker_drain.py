"""The real worker process on SIGTERM: it drains. Generations in flight on the
scheduler's session finish, new ones get UNAVAILABLE saying the worker is draining,
health answers NOT_SERVING, and the process exits 0; a generation that outlasts
``--drain-timeout-s`` is cut."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from monitor_agent.worker.process import check_args, parse_args
from scheduler_svc.worker_client import WorkerClients, WorkerStreamError
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.grpc_server import channel
from services.models.checkpoint import create_checkpoint
from tests.unit.test_worker_process import PROMPT, start_worker

# Big enough that LONG tokens take seconds on one core (~2 s measured on the dev box).
SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}
LONG = 1500
MAX_SEQ_LEN = 1600
EXIT_WAIT_S = 30.0
# How long a worker may take to act on SIGTERM (it is not the point of any test here).
DRAIN_SEEN_S = 30.0
# Slack, beyond the drain timeout, for a worker to cut its generations, stop and exit on
# a busy machine. The cut itself is told by the stream's UNAVAILABLE (a generation left to
# run would end with its final message); this bound catches a worker that lingers on.
EXIT_SLACK_S = 15.0
GREEDY = common.SamplingParams(ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return create_checkpoint(tmp_path_factory.mktemp("ckpt") / "drain", **SHAPE)


def request(request_id: str, max_tokens: int) -> worker_pb.WorkerServiceGenerateRequest:
    return worker_pb.WorkerServiceGenerateRequest(
        request_id=request_id, prompt=PROMPT, max_tokens=max_tokens, sampling=GREEDY
    )


def start(checkpoint: Path, run_dir: Path, drain_timeout_s: float):
    """A worker with two KV-cache slots; returns (process, address)."""
    proc, record = start_worker(
        checkpoint, run_dir / "ready.json", run_dir / "worker.log",
        "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch", "2",
        "--drain-timeout-s", str(drain_timeout_s),
    )  # fmt: skip
    return proc, f"127.0.0.1:{record['port']}"


async def health_once_draining(address: str) -> int:
    """Poll the worker's health until it stops answering SERVING (within DRAIN_SEEN_S);
    returns the status it answered then."""
    async with channel(address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        async with asyncio.timeout(DRAIN_SEEN_S):
            while True:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    return reply.status
                await asyncio.sleep(0.02)


def test_a_draining_worker_finishes_its_generation_and_refuses_new_ones(checkpoint, tmp_path):
    proc, address = start(checkpoint, tmp_path, drain_timeout_s=60)

    async def scenario():
        clients = WorkerClients()
        try:
            session = clients.session(address)
            stream = session.start(request("long", LONG))
            responses = [await stream.read()]
            proc.send_signal(signal.SIGTERM)
            # The worker takes the signal when it gets to it: wait until it says so.
            status = await health_once_draining(address)
            with pytest.raises(WorkerStreamError) as refused:
                await session.start(request("late", 4)).read()
            still_running = proc.poll() is None
            while not responses[-1].finish_reason:
                responses.append(await stream.read())
            stream.close()
            return status, refused.value, still_running, responses
        finally:
            await clients.close()

    try:
        status, refused, still_running, responses = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert refused.code == grpc.StatusCode.UNAVAILABLE
        assert refused.details.startswith("worker of deployment dep-test is draining: ")
        assert still_running, "the worker did not wait for its generation"
        assert len(responses) == LONG
        assert responses[-1].finish_reason == common.FINISH_REASON_LENGTH
        assert proc.wait(EXIT_WAIT_S) == 0, (tmp_path / "worker.log").read_text()
    finally:
        proc.kill()
        proc.wait(EXIT_WAIT_S)


def test_a_generation_that_outlasts_the_drain_timeout_is_cut(checkpoint, tmp_path):
    drain_timeout_s = 0.5
    proc, address = start(checkpoint, tmp_path, drain_timeout_s)
    try:
        with grpc.insecure_channel(address) as chan:
            stub = worker_service_pb2_grpc.WorkerServiceStub(chan)
            responses = stub.Generate(request("long", LONG), timeout=60)
            next(responses)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as cut:
                for _ in responses:
                    pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(EXIT_WAIT_S) == 0, (tmp_path / "worker.log").read_text()
        assert time.monotonic() - started < drain_timeout_s + EXIT_SLACK_S
    finally:
        proc.kill()
        proc.wait(EXIT_WAIT_S)


def test_a_worker_stopped_with_the_schedulers_session_open_logs_no_error(checkpoint, tmp_path):
    # Removing a deployment stops its worker while the scheduler's Session is still open:
    # that is no error (each such stop used to log an ERROR traceback of a CancelledError
    # in gRPC's task for the Session, cancelled by the closing event loop).
    proc, address = start(checkpoint, tmp_path, drain_timeout_s=5)

    async def scenario():
        # Three sessions, one per scheduler: the error came with most stops of a worker
        # with one session open, with every stop of one with three.
        schedulers = [WorkerClients() for _ in range(3)]
        try:
            for clients in schedulers:
                stream = clients.session(address).start(request("short", 4))
                while not (await stream.read()).finish_reason:
                    pass
            proc.send_signal(signal.SIGTERM)
            return await asyncio.to_thread(proc.wait, EXIT_WAIT_S)
        finally:
            for clients in schedulers:
                await clients.close()

    try:
        exit_code = asyncio.run(asyncio.wait_for(scenario(), 60))
        log = (tmp_path / "worker.log").read_text()
        assert exit_code == 0, log
        assert " ERROR " not in log and "Traceback" not in log, log
    finally:
        proc.kill()
        proc.wait(EXIT_WAIT_S)


def test_the_drain_timeout_comes_from_the_environment_unless_given(monkeypatch):
    argv = ["--deployment-id", "d", "--checkpoint", "c", "--ready-file", "r"]
    monkeypatch.setenv("ISERVE_DRAIN_TIMEOUT_S", "7.5")
    args = parse_args(argv)
    check_args(args)
    assert args.drain_timeout_s == 7.5
    args = parse_args([*argv, "--drain-timeout-s", "2"])
    check_args(args)
    assert args.drain_timeout_s == 2.0
    with pytest.raises(ValueError, match="--drain-timeout-s must be positive"):
        check_args(parse_args([*argv, "--drain-timeout-s", "0"]))
    monkeypatch.setenv("ISERVE_DRAIN_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="ISERVE_DRAIN_TIMEOUT_S"):
        check_args(parse_args(argv))
