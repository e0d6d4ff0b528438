"""Keepalive between iserve's channels and servers (services.transport.channel_options):
a call that carries no data for a while (a registration waiting on profiling, a request
queued at its worker) is pinged, and the server takes those pings. With a server option
gRPC does not know, the server kept its 5-minute minimum and ended such calls after
three pings with GOAWAY "too_many_pings". Pings every second here, for a short test."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from services.transport import channel_options

PING_MS = 1000
IDLE_S = 6.0  # 6 pings: two strikes past the three a server allows at its default


def test_a_call_idle_for_many_ping_intervals_is_not_cut():
    options = channel_options(keepalive_time_ms=PING_MS)
    ready, port, stop = threading.Event(), [], threading.Event()

    async def stream(request, context):
        yield b"start"
        await asyncio.sleep(IDLE_S)
        yield b"end"

    async def serve():
        server = grpc.aio.server(options=options)
        handler = grpc.method_handlers_generic_handler(
            "t.T", {"S": grpc.unary_stream_rpc_method_handler(stream)}
        )
        server.add_generic_rpc_handlers((handler,))
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}", options=options) as channel:
            started = time.monotonic()
            got = list(channel.unary_stream("/t.T/S")(b"", timeout=IDLE_S + 20))
        assert got == [b"start", b"end"]
        assert time.monotonic() - started >= IDLE_S
    finally:
        stop.set()
        thread.join(10)
