"""Cached AgentService stubs, one channel per agent address; which agents did not answer
the deployer's last call (``Reachability``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from services import transport
from services.api import agent_service_pb2_grpc
from services.api import common_pb2 as common

# How much of gRPC's reason a node's "does not answer" keeps.
REASON_CHARS = 300


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


class Reachability:
    """Which agents did not answer the deployer's last call to them (UNAVAILABLE: a TLS
    handshake they fail, a firewalled port, a process gone before its heartbeat lapsed).
    Their nodes take no placement until a call succeeds: a node heartbeating to Redis
    whose agent the deployer could not reach was chosen for every restart and
    deployment, each failing, until the restart budget was spent."""

    def __init__(self) -> None:
        # Agent address -> why its last call found it unreachable.
        self._unanswered: dict[str, str] = {}

    def unreachable(self, address: str, reason: str) -> None:
        self._unanswered[address] = " ".join(reason.split())[:REASON_CHARS]

    def answered(self, address: str) -> None:
        self._unanswered.pop(address, None)

    def forget_lapsed(self, nodes: Iterable[common.NodeState]) -> None:
        # A node seen without a heartbeat drops its mark: the agent that comes back there
        # is a new process, and its first call tries it afresh. A mark made while the
        # old one died ("connection refused") kept the new one, already listening, out
        # of placement until the reconciler's next call reached it.
        for node in nodes:
            if not node.alive:
                self._unanswered.pop(node.agent_address, None)

    def unanswered(self, nodes: Iterable[common.NodeState]) -> dict[str, str]:
        """Node id -> why its agent did not answer, for the live ``nodes`` whose agent
        (at the address it heartbeats now) did not answer the last call."""
        nodes = list(nodes)
        self.forget_lapsed(nodes)
        return {
            n.node_id: self._unanswered[n.agent_address]
            for n in nodes
            if n.alive and n.agent_address in self._unanswered
        }

    def usable(self, nodes: Iterable[common.NodeState]) -> list[common.NodeState]:
        """``nodes`` with those whose agent did not answer the last call taken as not
        alive, with why (``unreachable``)."""
        nodes = list(nodes)
        self.forget_lapsed(nodes)
        out = []
        for node in nodes:
            if node.alive and node.agent_address in self._unanswered:
                copy = common.NodeState()
                copy.CopyFrom(node)
                copy.alive = False
                copy.unreachable = self._unanswered[node.agent_address]
                node = copy
            out.append(node)
        return out
