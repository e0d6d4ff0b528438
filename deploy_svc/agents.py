"""Cached AgentService stubs, one channel per agent address."""

from __future__ import annotations

import asyncio

import grpc

from services import transport
from services.api import agent_service_pb2_grpc


class AgentClients:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, agent_service_pb2_grpc.AgentServiceStub] = {}
        self._closing: set[asyncio.Task] = set()

    def stub(self, address: str) -> agent_service_pb2_grpc.AgentServiceStub:
        """The stub of the agent at ``address``. A channel that failed to connect waits
        out gRPC's reconnect backoff (up to 5 s) and fails every call at once meanwhile:
        an agent started again within that time (its heartbeat back, the deployer
        restarting its replicas) would be called unreachable while it listens, each
        refusal a restart of the budget spent. Such a channel is replaced by a fresh one
        with connections of its own (a new channel would otherwise share the old one's,
        backoff and all), which connects at the call."""
        ch = self._channels.get(address)
        if ch is not None and ch.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            del self._channels[address], self._stubs[address]
            task = asyncio.get_running_loop().create_task(ch.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if address not in self._stubs:
            self._channels[address] = transport.current().aio_channel(address, own_connections=True)
            self._stubs[address] = agent_service_pb2_grpc.AgentServiceStub(self._channels[address])
        return self._stubs[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()
        if self._closing:
            await asyncio.gather(*self._closing)
