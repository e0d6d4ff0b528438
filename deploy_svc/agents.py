"""Cached AgentService stubs, one channel per agent address."""

from __future__ import annotations

from services.api import agent_service_pb2_grpc
from services.grpc_server import channel


class AgentClients:
    def __init__(self) -> None:
        self._channels: dict = {}
        self._stubs: dict[str, agent_service_pb2_grpc.AgentServiceStub] = {}

    def stub(self, address: str) -> agent_service_pb2_grpc.AgentServiceStub:
        if address not in self._stubs:
            self._channels[address] = channel(address)
            self._stubs[address] = agent_service_pb2_grpc.AgentServiceStub(self._channels[address])
        return self._stubs[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()
