"""Clients of the deployments' workers: one cached channel and stub per worker address."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from services.api import worker_service_pb2_grpc as worker_grpc
from services.grpc_server import channel


class WorkerClients:
    """``WorkerServiceStub`` per ``host:port``, created on first use and reused.

    gRPC channels reconnect on their own, so a channel is kept after a worker error;
    ``retain`` closes those of addresses no deployment uses any more.
    """

    def __init__(self) -> None:
        self._clients: dict[str, tuple[grpc.aio.Channel, worker_grpc.WorkerServiceStub]] = {}

    def stub(self, address: str) -> worker_grpc.WorkerServiceStub:
        client = self._clients.get(address)
        if client is None:
            chan = channel(address)
            client = (chan, worker_grpc.WorkerServiceStub(chan))
            self._clients[address] = client
        return client[1]

    async def retain(self, addresses: Iterable[str]) -> None:
        """Close the channels of every address not in ``addresses``."""
        keep = set(addresses)
        stale = [a for a in self._clients if a not in keep]
        closing = [self._clients.pop(a)[0].close() for a in stale]
        if closing:
            await asyncio.gather(*closing)

    async def close(self) -> None:
        await self.retain(())
