"""``run_server`` with a drain, over real gRPC and a real SIGTERM to this process: health
turns NOT_SERVING, new calls get UNAVAILABLE saying why, calls in flight finish within
the drain timeout or are cut after it, and a second signal ends the drain at once.
Health's List answers what Check answers, for every service."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import inference_service_pb2 as inference_pb
from services.api import inference_service_pb2_grpc as inference_grpc
from services.auth import policy
from services.auth.tokens import Principal
from services.drain import InFlight
from services.grpc_server import (
    ServerSecurity,
    ServiceBinding,
    channel,
    run_server,
    start_server,
)

TICK_S = 0.05
WAIT_S = 20.0


class Ticker(inference_grpc.InferenceServiceServicer):
    """Streams ``max_tokens`` messages, one every TICK_S seconds."""

    def __init__(self, events: list[str]) -> None:
        self.in_flight = InFlight("ticker")
        self.events = events

    async def Generate(self, request, context):
        self.in_flight.admit(context)
        try:
            for i in range(request.max_tokens):
                await asyncio.sleep(TICK_S)
                yield inference_pb.GenerateResponse(request_id=f"{request.request_id}:{i}")
        finally:
            self.events.append(f"call {request.request_id} ended")


async def serve_until_stopped(drain_timeout_s: float, client) -> tuple[object, list[str]]:
    """Run a Ticker server with a drain and ``client(address, events)``; returns what
    the client returned and the order of events (``"on_stop"``, the client's own)."""
    events: list[str] = []
    servicer = Ticker(events)
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_stop() -> None:
        events.append("on_stop")

    server = asyncio.create_task(
        run_server(
            "ticker",
            [
                ServiceBinding(
                    servicer,
                    inference_grpc.add_InferenceServiceServicer_to_server,
                    "iserve.v1.InferenceService",
                )
            ],
            "127.0.0.1:0",
            on_started=started.set_result,
            on_stop=on_stop,
            drain=servicer.in_flight.drain,
            drain_timeout_s=drain_timeout_s,
        )
    )
    port = await started
    try:
        result = await asyncio.wait_for(client(f"127.0.0.1:{port}", events), WAIT_S)
        await asyncio.wait_for(server, WAIT_S)
    finally:
        server.cancel()
    return result, events


async def read_rest(call) -> tuple[int, grpc.StatusCode]:
    """Messages read until the end of the call, and its status."""
    count = 0
    try:
        while await call.read() is not grpc.aio.EOF:
            count += 1
    except grpc.aio.AioRpcError as exc:
        return count, exc.code()
    return count, await call.code()


def sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_refuses_new_calls_and_lets_the_one_in_flight_finish():
    async def client(address: str, events: list[str]):
        async with channel(address) as chan:
            stub = inference_grpc.InferenceServiceStub(chan)
            call = stub.Generate(inference_pb.GenerateRequest(request_id="a", max_tokens=30))
            await call.read()  # the call is in flight
            sigterm()
            await asyncio.sleep(TICK_S)
            health = await health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(
                    inference_pb.GenerateRequest(request_id="b", max_tokens=1), timeout=5
                ).read()
            rest = await read_rest(call)
            return health.status, refused.value, rest

    (status, refused, rest), events = asyncio.run(serve_until_stopped(30.0, client))
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.details().startswith("ticker is draining: ")
    assert rest == (29, grpc.StatusCode.OK)
    # on_stop (which closes what the calls use) runs only after the last call ended on
    # the server (the client may see the end later: that order is the loop's to pick).
    assert events[-2:] == ["call a ended", "on_stop"]


def long_call_cut_by(signals: int):
    """A client that starts a 1,000-token call, sends SIGTERM ``signals`` times (0.3 s
    apart) and returns what was left of the call and how long after the last signal it
    ended."""

    async def client(address: str, events: list[str]):
        async with channel(address) as chan:
            stub = inference_grpc.InferenceServiceStub(chan)
            call = stub.Generate(inference_pb.GenerateRequest(request_id="a", max_tokens=1000))
            await call.read()  # the call is in flight
            loop = asyncio.get_running_loop()
            for n in range(signals):
                if n:
                    await asyncio.sleep(0.3)
                started = loop.time()
                sigterm()
            rest = await read_rest(call)
            return rest, loop.time() - started

    return client


def test_a_call_that_outlasts_the_drain_timeout_is_cut():
    client = long_call_cut_by(signals=1)
    ((count, code), cut_after_s), _events = asyncio.run(serve_until_stopped(0.5, client))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert count < 999
    assert 0.4 <= cut_after_s < 5.0


def test_a_second_signal_ends_the_drain_at_once():
    client = long_call_cut_by(signals=2)
    ((_count, code), cut_after_s), _events = asyncio.run(serve_until_stopped(30.0, client))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert cut_after_s < 5.0


class OneToken:
    """Knows one app-user token, ``user-token``."""

    unknown = "invalid or revoked token"

    async def authenticate(self, token: str) -> Principal | None:
        return Principal("t1", "app", policy.APP_USER, ("*",)) if token == "user-token" else None


def test_health_list_answers_each_services_status_to_any_token(caplog):
    """List was INTERNAL with a logged traceback: the library's servicer lacks it."""
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    async def scenario():
        binding = ServiceBinding(
            Ticker([]),
            inference_grpc.add_InferenceServiceServicer_to_server,
            "iserve.v1.InferenceService",
        )
        server, port, health = await start_server(
            [binding], "127.0.0.1:0", security=ServerSecurity(authenticator=OneToken())
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
                stub = health_pb2_grpc.HealthStub(chan)
                with pytest.raises(grpc.aio.AioRpcError) as anonymous:
                    await stub.List(health_pb2.HealthListRequest(), timeout=5)
                token = (("authorization", "Bearer user-token"),)
                listed = await stub.List(health_pb2.HealthListRequest(), metadata=token, timeout=5)
                await health.enter_graceful_shutdown()
                after = await stub.List(health_pb2.HealthListRequest(), metadata=token, timeout=5)
        finally:
            await server.stop(0)
        return anonymous.value.code(), listed, after

    anonymous, listed, after = asyncio.run(scenario())
    assert anonymous == grpc.StatusCode.UNAUTHENTICATED
    names = ["", "iserve.v1.InferenceService"]
    assert {n: s.status for n, s in listed.statuses.items()} == dict.fromkeys(names, serving)
    assert {n: s.status for n, s in after.statuses.items()} == dict.fromkeys(names, not_serving)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


HANGING_STOP = """
import asyncio, logging, os, signal
import services.grpc_server as server
logging.basicConfig(level=logging.INFO)
server.STOP_STACKS_AFTER_S = 0.3
async def close_the_store():
    await asyncio.sleep(60)  # a stop step that never ends
async def main():
    asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGTERM)
    await server.run_server("probe", [], "127.0.0.1:0", on_stop=close_the_store, grace_s=0.1)
asyncio.run(main())
"""


# What the hanging stop logs: the tasks' stacks (logging) and every thread's (faulthandler,
# written from its own watchdog thread, in either order).
HANG_LOGGED = ("probe still stopping; task", "in close_the_store", "Thread 0x")
HANG_LOGGED_WITHIN_S = 60.0


def test_a_stop_that_hangs_logs_where_each_task_and_thread_waits():
    proc = subprocess.Popen([sys.executable, "-c", HANGING_STOP], stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            lines.append(line)

    # Read stderr beside the wait: the process never ends by itself (its stop hangs), so
    # it is killed once everything looked for is logged, or after HANG_LOGGED_WITHIN_S.
    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    deadline = time.monotonic() + HANG_LOGGED_WITHIN_S
    try:
        while not all(part in "".join(lines) for part in HANG_LOGGED):
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        reader.join(10)
    log = "".join(lines)
    assert "probe still stopping; task" in log, log
    assert "in close_the_store" in log  # the awaited chain, not only the outer frame
    assert "Thread 0x" in log  # faulthandler's stacks of every thread
