"""Drain on the live stack.

A scheduler that gets SIGTERM answers health NOT_SERVING, refuses new requests with
UNAVAILABLE ("scheduler is draining: ..."), lets the streams in flight finish within
``ISERVE_DRAIN_TIMEOUT_S`` (cutting those that outlast it) and exits 0. Each test starts a
scheduler of its own against the stack's Redis, so the session's scheduler keeps serving.
Removing a deployment drains its worker the same way: the stream in flight finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import inference_service_pb2_grpc as infer_grpc
from services.api import model_service_pb2 as model_pb
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc as worker_grpc
from services.health import wait_serving
from services.ports import free_port
from tests.integration.conftest import SERVED_SHAPE
from tests.integration.helpers import deploy, make_checkpoint, register, rid, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GREEDY_NO_EOS = common.SamplingParams(ignore_eos=True)
PROMPT = "The river runs past the old mill"
# Beyond the drain timeout (or the end of the last call in flight), what a process gets
# to exit: generous, for a loaded 2-core box.
EXIT_MARGIN_S = 20.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Scheduler:
    """A scheduler process of this test's own, on a free port."""

    def __init__(self, stack, log_path: Path, drain_timeout_s: float):
        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = log_path
        env = {
            **stack.env,
            "ISERVE_SCHEDULER_ADDR": self.address,
            "ISERVE_SCHEDULER_METRICS_ADDR": "127.0.0.1:0",
            "ISERVE_DRAIN_TIMEOUT_S": str(drain_timeout_s),
            "PYTHONUNBUFFERED": "1",
        }
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "scheduler_svc"],
                cwd=ROOT,
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if not wait_serving(self.address, time.monotonic() + 60, self.proc):
            self.proc.kill()
            raise AssertionError(f"scheduler did not start:\n{self.log()}")
        self.channel = grpc.insecure_channel(self.address)
        self.inference = infer_grpc.InferenceServiceStub(self.channel)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> int | None:
        """The health status it answers, None when it does not answer."""
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return None
        return reply.status

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def start_scheduler(stack, tmp_path):
    started: list[Scheduler] = []

    def start(drain_timeout_s: float) -> Scheduler:
        scheduler = Scheduler(stack, tmp_path / f"scheduler{len(started)}.log", drain_timeout_s)
        started.append(scheduler)
        return scheduler

    yield start
    for scheduler in started:
        scheduler.close()


def long_request(deployment_id: str, max_tokens: int) -> infer_pb.GenerateRequest:
    return infer_pb.GenerateRequest(
        request_id=rid(),
        deployment_id=deployment_id,
        prompt=PROMPT,
        max_tokens=max_tokens,
        sampling=GREEDY_NO_EOS,
    )


def test_a_draining_scheduler_refuses_new_requests_and_finishes_the_stream(
    stack, served, start_scheduler
):
    # Far beyond what the stream in flight takes (about 7 s here, idle; more when the box
    # is loaded): it must finish, not be cut.
    drain_timeout_s = 120.0
    scheduler = start_scheduler(drain_timeout_s)
    stream = scheduler.inference.Generate(
        long_request(served.deployment_id, served.max_output_tokens), timeout=120
    )
    first = next(stream)
    assert first.HasField("delta")

    scheduler.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert wait_for(lambda: scheduler.health() == NOT_SERVING, timeout=15), scheduler.log()
    with pytest.raises(grpc.RpcError) as refused:
        list(scheduler.inference.Generate(long_request(served.deployment_id, 4), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details().startswith("scheduler is draining: "), refused.value.details()
    assert scheduler.proc.poll() is None, "the scheduler exited with a stream in flight"

    rest = list(stream)
    assert rest[-1].HasField("final"), "the stream in flight ended without its final message"
    final = rest[-1].final
    assert final.finish_reason == common.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == served.max_output_tokens
    assert sum(len(m.delta.token_ids) for m in [first, *rest[:-1]]) == served.max_output_tokens

    # The drain ends with the last call in flight, not at its timeout.
    assert scheduler.proc.wait(EXIT_MARGIN_S) == 0, scheduler.log()
    assert time.monotonic() - signalled < drain_timeout_s + EXIT_MARGIN_S
    log = scheduler.log()
    # Which signal stopped it (an operator's kill read as `iserve down` did, a probe).
    assert "scheduler stopping (SIGTERM received)" in log, log
    assert "scheduler draining: waiting up to 120 s for 1 call(s)" in log, log
    assert "scheduler drained" in log and "cancelling them" not in log, log


def test_a_stream_that_outlasts_the_drain_timeout_is_cut(stack, served, start_scheduler):
    drain_timeout_s = 0.5
    scheduler = start_scheduler(drain_timeout_s)
    stream = scheduler.inference.Generate(
        long_request(served.deployment_id, served.max_output_tokens), timeout=120
    )
    next(stream)
    scheduler.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    with pytest.raises(grpc.RpcError) as cut:
        for _message in stream:
            pass
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert scheduler.proc.wait(drain_timeout_s + EXIT_MARGIN_S) == 0, scheduler.log()
    assert time.monotonic() - signalled < drain_timeout_s + EXIT_MARGIN_S
    assert "still running after 0.5 s; cancelling them" in scheduler.log()

    # The worker stops generating for the scheduler that went away.
    with grpc.insecure_channel(served.worker_address) as channel:
        worker = worker_grpc.WorkerServiceStub(channel)

        def idle() -> bool:
            stats = worker.GetWorkerStats(worker_pb.GetWorkerStatsRequest(), timeout=5)
            return stats.active_requests == 0

        assert wait_for(idle, timeout=10)


def test_removing_a_deployment_lets_its_stream_in_flight_finish(stack):
    register(stack, "drain-llama", make_checkpoint(stack, "drain-llama", **SERVED_SHAPE))
    max_tokens = 1500
    dep = deploy(stack, "drain-llama", max_output_tokens=max_tokens).deployment
    deployment_id = dep.deployment_id
    try:
        stream = stack.inference.Generate(long_request(deployment_id, max_tokens), timeout=120)
        first = next(stream)
        assert first.HasField("delta")
        with ThreadPoolExecutor(1) as pool:
            removing = pool.submit(
                stack.deployments.RemoveDeployment,
                deploy_pb.RemoveDeploymentRequest(request_id=rid(), deployment_id=deployment_id),
                timeout=60,
            )
            rest = list(stream)
            removing.result()
        assert rest[-1].HasField("final"), "the stream in flight ended without its final message"
        assert rest[-1].final.finish_reason == common.FINISH_REASON_LENGTH
        assert rest[-1].final.usage.completion_tokens == max_tokens

        # The worker got its SIGTERM with the generation in flight, and waited for it.
        log = (stack.settings.state_dir / "logs" / f"worker-{deployment_id}-r0.log").read_text()
        assert f"worker of deployment {deployment_id} draining: waiting up to" in log
        assert f"worker of deployment {deployment_id} drained" in log
    finally:
        remove_if_there(stack, deployment_id)
        stack.models.DeleteModel(
            model_pb.DeleteModelRequest(request_id=rid(), model_id="drain-llama")
        )


def test_requests_waiting_when_a_deployment_is_removed_are_told_at_once(stack):
    """One slot: a stream runs, another request waits for the slot. Removing the
    deployment lets the stream finish (the drain) but sends the waiting request away
    at the next refresh (about a second; a record saying REMOVING closes its queues
    at once), not when the stream ends and the worker is gone."""
    register(stack, "drain-wait", make_checkpoint(stack, "drain-wait", **SERVED_SHAPE))
    max_tokens = 1500
    dep = deploy(stack, "drain-wait", max_output_tokens=max_tokens, batch_size=1).deployment
    deployment_id = dep.deployment_id
    ended: dict[str, float] = {}

    def waiting_request() -> grpc.RpcError | None:
        try:
            list(stack.inference.Generate(long_request(deployment_id, 8), timeout=120))
        except grpc.RpcError as exc:
            return exc
        finally:
            ended["waiting"] = time.monotonic()
        return None

    try:
        stream = stack.inference.Generate(long_request(deployment_id, max_tokens), timeout=120)
        assert next(stream).HasField("delta")
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(waiting_request)
            assert wait_for(lambda: waiting_count(stack, deployment_id) == 1, timeout=10)
            removing = pool.submit(
                stack.deployments.RemoveDeployment,
                deploy_pb.RemoveDeploymentRequest(request_id=rid(), deployment_id=deployment_id),
                timeout=60,
            )
            rest = list(stream)
            ended["stream"] = time.monotonic()
            removing.result()
            refused = waiting.result()
        assert rest[-1].final.usage.completion_tokens == max_tokens  # drained, not cut
        assert refused is not None, "the waiting request was served by a removed deployment"
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.details()
        assert "REMOVING" in refused.details() or "not found" in refused.details().lower()
        assert ended["waiting"] < ended["stream"], "it waited for the stream in flight to end"
    finally:
        remove_if_there(stack, deployment_id)
        stack.models.DeleteModel(
            model_pb.DeleteModelRequest(request_id=rid(), model_id="drain-wait")
        )


def waiting_count(stack, deployment_id: str) -> int:
    stats = stack.inference.GetServingStats(infer_pb.GetServingStatsRequest(request_id=rid()))
    return sum(s.requests_waiting for s in stats.deployments if s.deployment_id == deployment_id)


def remove_if_there(stack, deployment_id: str) -> None:
    """Remove a deployment unless it is gone already."""
    try:
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(request_id=rid(), deployment_id=deployment_id),
            timeout=60,
        )
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise


def test_a_gateway_told_to_stop_lets_its_streams_finish_with_done(stack, served, tmp_path):
    """SIGTERM (every `iserve down`) to a gateway with an SSE stream in flight: the
    stream runs to its last chunk and [DONE] within the drain timeout. sse-starlette
    cancelled it at once: it ended cleanly but truncated, with neither a finish_reason
    nor [DONE], which a client cannot tell from a complete answer."""
    import httpx

    address = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        **stack.env,
        "ISERVE_GATEWAY_ADDR": address,
        "ISERVE_DRAIN_TIMEOUT_S": "120",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway_svc"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://{address}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, timeout=60), log_path.read_text(errors="replace")
        body = {
            "model": served.model_id,
            "prompt": PROMPT,
            "max_tokens": served.max_output_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        lines = []
        with httpx.stream(
            "POST", f"http://{address}/v1/completions", json=body, timeout=120
        ) as reply:
            events = reply.iter_lines()
            for line in events:
                lines.append(line)
                if line.startswith("data: {"):
                    break  # the first chunk: the stream is in flight
            gateway.send_signal(signal.SIGTERM)
            lines += list(events)
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]", data[-3:]
        assert '"finish_reason":"length"' in data[-2].replace(" ", ""), data[-2]
        # uvicorn re-raises the signal once it has shut down: the exit is by SIGTERM.
        assert gateway.wait(EXIT_MARGIN_S) in (0, -signal.SIGTERM)
    finally:
        if gateway.poll() is None:
            gateway.kill()
        gateway.wait(10)
