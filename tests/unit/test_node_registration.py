"""Node registration against a real redis-server: a node's registration replaces its
device set, the live agent's address wins back the node, a node id held by a live
agent is refused, and port 0 is pinned before the agent registers."""

from __future__ import annotations

import asyncio

import pytest

from monitor_agent.agent import pin_any_port
from monitor_agent.devices import virtual_devices
from monitor_agent.monitor import DeviceMonitor, DeviceSample, live_holder
from services.aio import cancel_and_wait
from services.api import common_pb2 as common
from services.state import keys
from services.state.store import NodeTakenOver, ReservationError

MIB = 1 << 20
# The monitor registers every 50 ms here: a limit for one that never does.
NODE_WAIT_S = 10.0


def _node(address: str, *device_ids: str) -> common.NodeState:
    return common.NodeState(
        node_id="n0",
        agent_address=address,
        devices=[
            common.DeviceState(
                ref=common.DeviceRef(node_id="n0", device_id=d), total_bytes=1024 * MIB
            )
            for d in device_ids
        ],
    )


def test_registering_fewer_devices_removes_the_missing_ones(run):
    async def body(store):
        await store.register_node(_node("127.0.0.1:1", "cpu0", "cpu1"), ttl_s=5)
        await store.reserve("dep", {("n0", "cpu1"): 100 * MIB})
        await store.register_node(_node("127.0.0.1:1", "cpu0"), ttl_s=5)
        [node] = await store.list_nodes()
        assert [d.ref.device_id for d in node.devices] == ["cpu0"]
        assert not await store.redis.exists(keys.device("n0", "cpu1"))
        with pytest.raises(ReservationError, match="n0/cpu1 is unknown"):
            await store.reserve("other", {("n0", "cpu1"): MIB})
        # Releasing a reservation on the gone device neither fails nor recreates it.
        assert await store.release("dep") == 1
        assert not await store.redis.exists(keys.device("n0", "cpu1"))

    run(body)


def test_a_device_that_returns_counts_the_reservations_still_naming_it(run):
    async def body(store):
        await store.register_node(_node("127.0.0.1:1", "cpu0", "cpu1"), ttl_s=5)
        await store.reserve("dep", {("n0", "cpu1"): 100 * MIB})
        await store.register_node(_node("127.0.0.1:1", "cpu0"), ttl_s=5)
        await store.register_node(_node("127.0.0.1:1", "cpu0", "cpu1"), ttl_s=5)
        back = await store.get_device(common.DeviceRef(node_id="n0", device_id="cpu1"))
        assert back.reserved_bytes == 100 * MIB
        await store.release("dep")
        back = await store.get_device(common.DeviceRef(node_id="n0", device_id="cpu1"))
        assert back.reserved_bytes == 0

    run(body)


def test_a_dead_node_shows_when_it_was_last_seen_and_is_forgotten_only_when_unheld(run):
    async def body(store):
        node = _node("127.0.0.1:1", "cpu0", "cpu1")
        await store.register_node(node, ttl_s=0.05)
        await store.publish_devices("n0", node.devices, ttl_s=0.05)
        [alive] = await store.list_nodes()
        seen = alive.heartbeat_at_unix_ms
        assert alive.alive and seen > 0
        await store.reserve("dep", {("n0", "cpu1"): 100 * MIB})
        await asyncio.sleep(0.1)  # the heartbeat lapses
        [dead] = await store.list_nodes()
        assert not dead.alive and dead.heartbeat_at_unix_ms == seen  # its last heartbeat
        # Seen since the cut-off, or memory reserved on it: kept.
        assert not await store.forget_node("n0", seen)
        assert not await store.forget_node("n0", seen + 1)
        await store.release("dep")
        assert await store.forget_node("n0", seen + 1)
        assert await store.list_nodes() == []
        assert not await store.redis.exists(keys.device("n0", "cpu0"), keys.node_devices("n0"))
        assert not await store.forget_node("n0", seen + 1)  # nothing left to forget
        # Its agent back: registered as new.
        await store.register_node(node, ttl_s=5)
        [back] = await store.list_nodes()
        assert back.alive and [d.reserved_bytes for d in back.devices] == [0, 0]
        assert not await store.forget_node("n0", seen + 10**9)  # alive: kept

    run(body)


class _IdleSampler:
    def sample(self, devices):
        return {d.device_id: DeviceSample(0, 0.0) for d in devices}


async def node_until(store, address: str, what: str) -> common.NodeState:
    """Node n0 once it is registered at ``address``; fails naming ``what`` after
    NODE_WAIT_S."""
    node = None
    try:
        async with asyncio.timeout(NODE_WAIT_S):
            while True:
                node = await store.get_node("n0")
                if node is not None and node.agent_address == address:
                    return node
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}: {node}")


def test_the_heartbeating_agent_takes_its_node_back_from_a_duplicate(run):
    async def body(store):
        monitor = DeviceMonitor(
            node_id="n0",
            agent_address="127.0.0.1:1",
            devices=virtual_devices(2, 1024 * MIB, [0], "x86_64"),
            store=store,
            sampler=_IdleSampler(),
            heartbeat_ttl_s=5,
            interval_s=0.05,
        )
        task = asyncio.create_task(monitor.run())
        try:
            await node_until(store, "127.0.0.1:1", "the agent to register")
            # A duplicate agent with the same node id registers, then dies.
            await store.register_node(_node("127.0.0.1:2", "cpu0"), ttl_s=5)
            node = await node_until(store, "127.0.0.1:1", "the agent to take its node back")
        finally:
            await cancel_and_wait([task])
        assert [d.ref.device_id for d in node.devices] == ["cpu0", "cpu1"]

    run(body)


def test_a_node_id_held_by_a_live_answering_agent_is_refused(run):
    asked = []

    async def answers(address):
        asked.append(address)
        return address == "127.0.0.1:1"

    async def body(store):
        assert await live_holder(store, "n0", answers) is None  # unknown
        await store.register_node(_node("127.0.0.1:1", "cpu0"), ttl_s=5)
        assert await live_holder(store, "n0", answers) == "127.0.0.1:1"
        # An answer at this agent's own address is another agent's (it asks before it
        # listens: a restart finds none there, and a second one sharing the port was
        # let in and pushed a healthy agent off its node: a probe).
        assert await live_holder(store, "n0", answers) == "127.0.0.1:1"
        await store.register_node(_node("127.0.0.1:3", "cpu0"), ttl_s=5)
        assert await live_holder(store, "n0", answers) is None  # silent
        await store.redis.delete(keys.node_heartbeat("n0"))
        assert await live_holder(store, "n0", answers) is None  # dead

    run(body)
    assert asked == ["127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:3"]


def test_port_zero_is_pinned_to_a_real_port_before_the_agent_registers():
    env = {"ISERVE_AGENT_ADDR": "127.0.0.1:0"}
    pin_any_port(env)
    host, _, port = env["ISERVE_AGENT_ADDR"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    env = {"ISERVE_AGENT_ADDR": "127.0.0.1:50065"}
    pin_any_port(env)
    assert env == {"ISERVE_AGENT_ADDR": "127.0.0.1:50065"}


def test_an_agent_replaced_while_frozen_stops_rather_than_share_its_node_id(run):
    """A SIGSTOPped agent's id was taken by a new agent (the frozen one did not answer
    the start-up check); resumed, both registered the id in turn and a deployment's rank
    ran twice (a probe). The replaced agent now finds another holder and gives up; one
    whose replacement died since takes its node back."""

    def monitor(store, address: str) -> DeviceMonitor:
        return DeviceMonitor(
            node_id="n0",
            agent_address=address,
            devices=virtual_devices(1, 1024 * MIB, [0], "x86_64"),
            store=store,
            sampler=_IdleSampler(),
            heartbeat_ttl_s=5,
            interval_s=0.05,
        )

    async def body(store):
        old, new = monitor(store, "127.0.0.1:1"), monitor(store, "127.0.0.1:2")
        await old.register()  # its first registration: it holds the id
        await old.register()
        await new.register()  # started while the old one was frozen: takes the id
        given_up = []

        async def give_up(exc: NodeTakenOver) -> None:
            given_up.append(exc.holder_address)

        old.on_taken_over = give_up
        before = await store.get_node("n0")
        await asyncio.wait_for(old.run(), NODE_WAIT_S)  # returns: it gave up
        assert given_up == ["127.0.0.1:2"]
        assert (await store.get_node("n0")).agent_address == before.agent_address == "127.0.0.1:2"
        with pytest.raises(NodeTakenOver, match="taken over by the agent at 127.0.0.1:2"):
            await old.register()
        # The new holder died (its heartbeat lapsed): the old one may hold the node again.
        await store.redis.delete(keys.node_heartbeat("n0"))
        await old.register()
        assert (await store.get_node("n0")).agent_address == "127.0.0.1:1"
        with pytest.raises(NodeTakenOver, match="127.0.0.1:1"):
            await new.register()

    run(body)
