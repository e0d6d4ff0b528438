"""A channel reaches a peer that comes back within seconds, however long it was away:
gRPC's own reconnect backoff grows to 120 s, and a node's agent back from a minute's
outage stayed unreachable to the deployer for 35-70 s."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.ports import free_port
from services.transport import CHANNEL_OPTIONS, MAX_RECONNECT_BACKOFF_MS

DOWN_S = 30.0  # long enough for the default backoff to pass 10 s between attempts


def test_a_peer_back_from_an_outage_is_reached_within_the_capped_backoff():
    async def scenario() -> float:
        port = free_port()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        started = time.monotonic()
        while time.monotonic() - started < DOWN_S:  # the peer is away: calls fail
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Check(request, timeout=0.5)
            await asyncio.sleep(1.0)
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        back = time.monotonic()
        try:
            while True:
                try:
                    await stub.Check(request, timeout=0.5)
                    return time.monotonic() - back
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)
        finally:
            await channel.close()
            await server.stop(0)

    reached_s = asyncio.run(scenario())
    # The cap and its 20 % jitter, with slack for polls (0.5 s calls 0.2 s apart) and a
    # busy machine; without the cap it took 35-70 s.
    assert reached_s < MAX_RECONNECT_BACKOFF_MS / 1000 * 1.2 + 5.0, reached_s
