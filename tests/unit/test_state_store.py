"""StateStore against a real redis-server: records, reservations, events."""

from __future__ import annotations

import asyncio

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.state import keys
from services.state.capacity import FREE_BYTES_LUA, free_bytes
from services.state.store import ReservationError, StateStore

MIB = 1 << 20


def _node(devices=2, total=1024 * MIB) -> common.NodeState:
    return common.NodeState(
        node_id="n0",
        agent_address="127.0.0.1:1",
        devices=[
            common.DeviceState(
                ref=common.DeviceRef(node_id="n0", device_id=f"cpu{i}"), total_bytes=total
            )
            for i in range(devices)
        ],
    )


def test_keys_live_under_the_prefix_and_refuse_colons():
    assert keys.model("m").startswith("iserve:")
    assert keys.device("n", "d") == "iserve:device:n:d"
    with pytest.raises(ValueError):
        keys.model("a:b")
    with pytest.raises(ValueError):
        keys.deployment("")


def test_models_are_created_once(run):
    async def body(store):
        m = model_pb.Model(model_id="m1", checkpoint_path="m1")
        assert await store.create_model(m)
        assert not await store.create_model(m)
        assert [x.model_id for x in await store.list_models()] == ["m1"]
        assert (await store.get_model("m1")).checkpoint_path == "m1"
        assert await store.delete_model("m1")
        assert await store.get_model("m1") is None and await store.list_models() == []

    run(body)


def test_a_node_stopped_on_purpose_is_dead_at_once_and_says_so_until_it_registers(run):
    """A clean stop of an agent (SIGTERM) left its heartbeat to lapse, and the deployer
    then called the node lost ("do not answer"), as if it had crashed."""

    async def body(store):
        await store.register_node(_node(), ttl_s=5)
        assert (await store.get_node("n0")).alive
        await store.mark_node_stopped("n0", ttl_s=60)
        stopped = await store.get_node("n0")
        assert not stopped.alive and stopped.stopped_at_unix_ms > 0
        assert [n.stopped_at_unix_ms for n in await store.list_nodes()] == [
            stopped.stopped_at_unix_ms
        ]
        assert await store.nodes_back_after_a_stop(["n0"]) == set()
        await store.register_node(_node(), ttl_s=5)  # back
        back = await store.get_node("n0")
        assert back.alive and back.stopped_at_unix_ms == 0
        # Back within a second, before the deployer's node check saw the stop: said so for
        # a minute, through the agent's later registrations too.
        await store.register_node(_node(), ttl_s=5)
        assert await store.nodes_back_after_a_stop(["n0", "n1"]) == {"n0"}

    run(body)


def test_reserve_is_all_or_nothing_and_release_is_idempotent(run):
    async def body(store):
        await store.register_node(_node(), ttl_s=5)
        await store.reserve("a", {("n0", "cpu0"): 600 * MIB})
        with pytest.raises(ReservationError, match="cpu0"):
            await store.reserve("b", {("n0", "cpu1"): 100 * MIB, ("n0", "cpu0"): 600 * MIB})
        # b changed nothing on cpu1 although cpu1 had room.
        assert (
            await store.get_device(common.DeviceRef(node_id="n0", device_id="cpu1"))
        ).reserved_bytes == 0
        assert await store.reservation_owners() == {"a"}
        with pytest.raises(ReservationError, match="unknown"):
            await store.reserve("c", {("n0", "cpu9"): 1})
        with pytest.raises(ReservationError, match="already"):
            await store.reserve("a", {("n0", "cpu1"): 1})
        dev = await store.get_device(common.DeviceRef(node_id="n0", device_id="cpu0"))
        assert (dev.reserved_bytes, dev.free_bytes) == (600 * MIB, 424 * MIB)
        assert await store.release("a") == 1
        assert await store.release("a") == 0
        dev = await store.get_device(common.DeviceRef(node_id="n0", device_id="cpu0"))
        assert (dev.reserved_bytes, dev.free_bytes) == (0, 1024 * MIB)

    run(body)


def test_concurrent_reservations_never_oversubscribe(run):
    async def body(store):
        await store.register_node(_node(devices=1), ttl_s=5)
        stores = [StateStore(store.redis) for _ in range(20)]

        async def attempt(i, s):
            try:
                await s.reserve(f"d{i}", {("n0", "cpu0"): 100 * MIB})
                return True
            except ReservationError:
                return False

        results = await asyncio.gather(*(attempt(i, s) for i, s in enumerate(stores)))
        assert sum(results) == 10
        dev = await store.get_device(common.DeviceRef(node_id="n0", device_id="cpu0"))
        assert dev.reserved_bytes == 1000 * MIB

    run(body)


def test_the_state_format_claim_keeps_the_newest_when_versions_start_together(run):
    """Two services of different versions starting on one Redis: each read the stored
    format, then wrote its own when larger, so the older one could write its number over
    the newer one's and the newer records went unrefused by the older iserve."""

    async def body(store):
        for _ in range(5):
            await store.redis.delete(keys.state_format())
            claims = [StateStore(store.redis).claim_state_format(f) for f in (7, 6, 5, 7, 6)]
            before = await asyncio.gather(*claims)
            assert int(await store.redis.get(keys.state_format())) == 7
            assert sorted(before)[0] == 0 and all(b in (0, 5, 6, 7) for b in before)
        assert await store.claim_state_format(3) == 7  # an older one learns of the newer
        assert int(await store.redis.get(keys.state_format())) == 7

    run(body)


def test_measured_use_counts_against_free_memory(run):
    async def body(store):
        node = _node(devices=1)
        await store.register_node(node, ttl_s=5)
        node.devices[0].used_bytes = 900 * MIB
        await store.publish_devices("n0", node.devices, ttl_s=5)
        with pytest.raises(ReservationError, match="124 MiB free"):
            await store.reserve("x", {("n0", "cpu0"): 200 * MIB})
        [listed] = await store.list_nodes()
        assert listed.alive and listed.devices[0].free_bytes == 124 * MIB

    run(body)


def test_deployments_and_request_ids(run):
    async def body(store):
        d = deploy_pb.Deployment(deployment_id="d1", model_id="m", request_id="r1")
        await store.put_deployment(d)
        assert await store.claim_deploy_request("r1", "d1") is None
        assert await store.claim_deploy_request("r1", "d2") == "d1"
        assert [x.deployment_id for x in await store.list_deployments("m")] == ["d1"]
        assert await store.list_deployments("other") == []
        await store.delete_deployment(d)
        assert await store.get_deployment("d1") is None
        assert await store.claim_deploy_request("r1", "d3") is None

    run(body)


def test_events_are_read_in_order_after_an_id(run):
    async def body(store):
        start = await store.last_event_id()
        await store.publish_event("a", deployment_id="d1")
        await store.publish_event("b", deployment_id="d2")
        events = await store.read_events(start, block_ms=100)
        assert [e["kind"] for _, e in events] == ["a", "b"]
        assert await store.read_events(events[-1][0], block_ms=50) == []

    run(body)


def test_profiles_and_calibrations_round_trip(run):
    from services.api import estimator_service_pb2 as estimator_pb

    async def body(store):
        profile = model_pb.GetProfileResponse(model_id="m1", skipped=["(2,1): 1 device"])
        profile.measurements.add(variant_name="fp32", num_layers=2, ttft_ms=1.5)
        await store.put_profile(profile)
        assert (await store.get_profile("m1")).measurements[0].ttft_ms == 1.5
        assert await store.get_profile("m2") is None
        await store.put_calibration(estimator_pb.Calibration(hardware_type="cpu-x86_64", alpha=1.1))
        assert (await store.get_calibration("cpu-x86_64")).alpha == pytest.approx(1.1)
        assert [c.hardware_type for c in await store.list_calibrations()] == ["cpu-x86_64"]
        await store.delete_model("m1")
        assert await store.get_profile("m1") is None

    run(body)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    total=st.integers(0, 1 << 44),
    used=st.integers(0, 1 << 44),
    reserved=st.integers(0, 1 << 44),
)
def test_the_free_memory_rule_is_the_same_in_python_and_in_lua(redis_url, total, used, reserved):
    script = (
        "local total, used, reserved = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])\n"
        f"return {FREE_BYTES_LUA}"
    )
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.eval(script, 0, total, used, reserved) == free_bytes(total, used, reserved)
    finally:
        client.close()


@pytest.mark.parametrize(("used", "reserved"), [(700, 0), (0, 700), (300, 700), (900, 100)])
def test_a_reservation_fits_exactly_the_free_bytes_python_reports(run, used, reserved):
    async def body(store):
        await store.register_node(_node(devices=1, total=1024 * MIB), ttl_s=5)
        ref = common.DeviceRef(node_id="n0", device_id="cpu0")
        await store.redis.hset(keys.device("n0", "cpu0"), mapping={"used": used * MIB})
        if reserved:
            await store.reserve("held", {("n0", "cpu0"): reserved * MIB})
        free = (await store.get_device(ref)).free_bytes
        assert free == free_bytes(1024 * MIB, used * MIB, reserved * MIB)
        with pytest.raises(ReservationError) as refused:
            await store.reserve("one-too-many", {("n0", "cpu0"): free + 1})
        assert refused.value.free_bytes == free
        await store.reserve("exact", {("n0", "cpu0"): free})

    run(body)
