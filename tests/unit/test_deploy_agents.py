"""The deployer's agent channels: an agent back on its address within gRPC's reconnect
backoff is reached at once, not refused as unreachable (a real server on a real port)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deploy_svc.agents import AgentClients
from services.api import agent_service_pb2 as agent_pb
from services.api import agent_service_pb2_grpc
from services.ports import free_port


class _Agent(agent_service_pb2_grpc.AgentServiceServicer):
    async def ListWorkers(self, request, context):
        return agent_pb.ListWorkersResponse()


async def _serve(address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    agent_service_pb2_grpc.add_AgentServiceServicer_to_server(_Agent(), server)
    server.add_insecure_port(address)
    await server.start()
    return server


def test_an_agent_started_again_is_reached_at_once():
    async def scenario():
        address = f"127.0.0.1:{free_port()}"
        agents = AgentClients()
        try:
            # The agent is down: the call fails and the channel enters its backoff.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agents.stub(address).ListWorkers(agent_pb.ListWorkersRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            server = await _serve(address)  # back, well within the backoff
            try:
                reply = await agents.stub(address).ListWorkers(
                    agent_pb.ListWorkersRequest(), timeout=5
                )
                assert list(reply.workers) == []
            finally:
                await server.stop(None)
        finally:
            await agents.close()

    asyncio.run(scenario())
