"""The gateway's HTTP protocol on a real uvicorn server: a request that does not arrive
whole within the deadline has its connection closed; whole requests, and responses
that stream for longer than the deadline, are served (a probe held 400 connections open
with half-sent requests, and the gateway never closed one)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from gateway_svc.protocol import DeadlineH11Protocol

DEADLINE_S = 0.5


class QuickDeadline(DeadlineH11Protocol):
    read_timeout_s = DEADLINE_S


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/slow":  # streams for longer than the deadline
        for _ in range(4):
            await asyncio.sleep(DEADLINE_S / 2)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, http=QuickDeadline, log_level="warning", lifespan="off")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not running.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield port
    running.should_exit = True
    thread.join(10)


def _exchange(port: int, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """What the server sends back to ``data`` until it closes (or ``wait_s`` passes),
    and when it closed (seconds after sending; inf when it did not)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(data)
        sent = time.monotonic()
        sock.settimeout(wait_s)
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except TimeoutError:
            return received, float("inf")
        return received, time.monotonic() - sent


def test_half_sent_requests_are_closed_and_whole_ones_served(server):
    half_header = b"POST /echo HTTP/1.1\r\nHost: x\r\nX-a: "
    half_body = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789"
    for stalled in (b"", half_header, half_body):
        received, closed_after = _exchange(server, stalled, wait_s=5)
        assert received == b"" and closed_after < 3, (stalled, received, closed_after)
    whole = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
    received, _ = _exchange(server, whole, wait_s=5)
    assert received.startswith(b"HTTP/1.1 200") and b"hello" in received
    # A response may take longer than the deadline: only the request is timed.
    slow = b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    received, _ = _exchange(server, slow, wait_s=5)
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"x") >= 4


def test_a_health_probe_answered_by_something_not_http_is_false_not_a_traceback():
    """`iserve up`'s wait for the gateway died with http.client.BadStatusLine once: its
    probe had connected to itself (its source port drawn equal to the gateway's)."""
    from services.health import http_ok

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def echo_a_request_line():
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(b"GET /health HTTP/1.1\r\n\r\n")

    thread = threading.Thread(target=echo_a_request_line, daemon=True)
    thread.start()
    try:
        assert http_ok(f"http://127.0.0.1:{port}/health", timeout_s=5) is False
    finally:
        thread.join(5)
        listener.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /echo HTTP/1.1\r\n\r\n",  # no Host
    ],
)
def test_a_request_h11_cannot_parse_is_a_400_in_openais_error_body(server, request_bytes):
    # uvicorn answered these in plain text, every other error of the gateway in JSON.
    received, closed_after = _exchange(server, request_bytes, 10)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), received
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "HTTP/1.1" in error["message"]
    assert closed_after < 10
