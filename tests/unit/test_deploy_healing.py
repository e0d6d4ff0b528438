"""Self-healing deployments: the restart budget and backoff and where a replica starts
again (deploy_svc.healing, pure), and the controller restarting a replica against a real
Redis with a fake agent (deploy_svc.healer)."""

from __future__ import annotations

import asyncio
import json
import logging
import types

import grpc
import pytest

from deploy_svc.agents import Reachability
from deploy_svc.healing import (
    GiveUp,
    Restart,
    RestartPolicy,
    RestartRecord,
    after_failure,
    after_node_loss,
    held_placements,
    placements_to_try,
    restore,
    served_again_note,
    waiting_for_nodes,
)
from deploy_svc.reconciler import CUT_OFF, Reconciler
from services.aio import cancel_and_wait
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.drain import worker_stop_s
from services.errors import CHECKPOINT_UNUSABLE, IServeError
from services.reservation import memory_blocks
from services.state.store import StateStore, StateStoreUnavailable
from tests.unit.test_deploy_replicas import (
    FAILED,
    READY,
    FakeAgent,
    FakeRpcError,
    controller_on,
    deploy_request,
    devices_of,
    model,
    node,
    nothing_left,
    reserved,
)

STARTING = deploy_pb.DEPLOYMENT_STATE_STARTING
FAST = RestartPolicy(max_restarts=2, first_backoff_s=0.01, max_backoff_s=0.02)


# ---- budget and backoff (pure) -----------------------------------------------------------


def test_backoff_doubles_from_the_first_and_stops_at_the_cap():
    policy = RestartPolicy(first_backoff_s=1.0, max_backoff_s=10.0)
    assert [policy.backoff_s(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_restarts_are_counted_until_the_budget_is_spent_then_it_gives_up():
    policy = RestartPolicy(max_restarts=3, first_backoff_s=1.0)
    record, delays, now = None, [], 1_000
    for error in ["e1", "e2", "e3"]:
        step = after_failure(policy, record, error, now)
        assert isinstance(step, Restart)
        delays.append(step.delay_s)
        record, now = step.record, now + 5_000
    assert delays == [1.0, 2.0, 4.0]
    assert record == RestartRecord(in_a_row=3, total=3, last_error="e3", last_failure_ms=11_000)
    step = after_failure(policy, record, "e4", now)
    assert isinstance(step, GiveUp)
    assert step.reason == "gave up after 3 restart(s) in a row (at most 3); last error: e4"
    assert step.record.last_error == "e4" and step.record.total == 3


def test_a_node_lost_spends_no_budget_but_is_counted_and_named():
    spent = RestartRecord(in_a_row=2, total=4, last_error="old", last_failure_ms=1_000)
    step = after_node_loss(spent, "node agent(s) n1 stopped heartbeating")
    assert step.delay_s == 0.0
    assert step.record == RestartRecord(
        in_a_row=2,
        total=5,
        last_error="node agent(s) n1 stopped heartbeating",
        last_failure_ms=1_000,
    )
    assert step.note == (
        "restart now after: node agent(s) n1 stopped heartbeating (no restart budget spent)"
    )
    assert served_again_note(step.record) == (
        "restarted 5 time(s) (2 in a row against the restart budget); last error: node "
        "agent(s) n1 stopped heartbeating"
    )


def test_a_failure_long_after_the_last_one_starts_a_fresh_budget():
    policy = RestartPolicy(max_restarts=1, reset_after_s=60)
    spent = RestartRecord(in_a_row=1, total=4, last_error="old", last_failure_ms=1_000)
    assert isinstance(after_failure(policy, spent, "soon", 30_000), GiveUp)
    step = after_failure(policy, spent, "later", 61_000)
    assert isinstance(step, Restart)
    assert step.delay_s == policy.first_backoff_s
    assert (step.record.in_a_row, step.record.total) == (1, 5)
    assert step.note == "restart 1 in 1 s after: later"


def test_a_restore_spends_no_budget_and_says_why():
    spent = RestartRecord(in_a_row=2, total=4, last_error="old", last_failure_ms=1_000)
    step = restore(spent, "the stack stopped")
    assert (step.delay_s, step.record) == (0.0, spent)
    assert step.note == "starting again: the stack stopped"
    assert restore(None, "x").record == RestartRecord()
    assert served_again_note(RestartRecord()) == "serves again after a stop of the stack"
    assert served_again_note(spent) == (
        "restarted 4 time(s) (2 in a row against the restart budget); last error: old"
    )
    # A restore names no failure: the record's last error was another replica's, or
    # from before the stop.
    assert served_again_note(spent, step.note) == "serves again after a stop of the stack"


def test_a_record_round_trips_through_json():
    record = RestartRecord(2, 7, "worker rank 0 exited (-9)", 123)
    assert RestartRecord.from_json(record.to_json()) == record


# ---- where it starts again (pure) --------------------------------------------------------


CONFIG = common.DeploymentConfig(
    tensor_parallel=1, pipeline_parallel=1, batch_size=1, dtype=common.PRECISION_FLOAT32
)
FIXED, BLOCK = memory_blocks(model().shape, CONFIG, 128)
RANK_BYTES = FIXED + 2 * BLOCK


def placed_on(node_id: str, device_id: str) -> common.Placement:
    return common.Placement(
        stages=[
            common.StagePlacement(
                stage=0,
                first_layer=0,
                layer_count=2,
                devices=[common.DeviceRef(node_id=node_id, device_id=device_id)],
                reserved_bytes=[RANK_BYTES],
            )
        ]
    )


def stages_on(node_ids: tuple[str, ...], rank_bytes: int) -> common.Placement:
    """A pipeline of one single-layer stage per node, on each node's cpu0."""
    return common.Placement(
        stages=[
            common.StagePlacement(
                stage=i,
                first_layer=i,
                layer_count=1,
                devices=[common.DeviceRef(node_id=node_id, device_id="cpu0")],
                reserved_bytes=[rank_bytes],
            )
            for i, node_id in enumerate(node_ids)
        ]
    )


def test_the_old_devices_come_first_while_their_node_lives():
    nodes = [node(1, 1)]
    tries = placements_to_try(model(), CONFIG, placed_on("node0", "cpu1"), nodes, [], 128)
    # Then, should it fail to start there, elsewhere (not the old device again).
    assert [devices_of(p) for p in tries] == [["node0/cpu1"], ["node0/cpu0"]]
    assert tries[0].stages[0].reserved_bytes == [RANK_BYTES]


def test_a_replica_whose_node_is_gone_goes_elsewhere_and_not_on_another_replica():
    dead = node(1, node_id="node0")
    dead.alive = False
    nodes = [dead, node(1, 1, node_id="node1")]
    other = placed_on("node1", "cpu0")
    tries = placements_to_try(model(), CONFIG, placed_on("node0", "cpu0"), nodes, [other], 128)
    assert [devices_of(p) for p in tries] == [["node1/cpu1"]]
    assert tries[0].stages[0].reserved_bytes == [RANK_BYTES]


def test_nothing_to_try_when_no_live_device_has_room():
    dead = node(1)
    dead.alive = False
    assert placements_to_try(model(), CONFIG, placed_on("node0", "cpu0"), [dead], [], 128) == []
    small = node(0.01)
    tries = placements_to_try(model(), CONFIG, placed_on("node0", "cpu0"), [small], [], 128)
    # The old placement is still offered (the reservation will say it has no room).
    assert [devices_of(p) for p in tries] == [["node0/cpu0"]]


def test_a_device_its_node_no_longer_has_is_not_offered_and_is_named():
    """`iserve up --devices 1` after a stack of two: node0 lives, cpu1 is gone. The old
    placement was offered, and its reservation refused ("device node0/cpu1 is unknown")
    at every restart, which then read as the reason (a tester)."""
    from deploy_svc.healing import gone_devices

    small = node(0.01)  # node0 with cpu0 only, and no room on it
    old = placed_on("node0", "cpu1")
    assert placements_to_try(model(), CONFIG, old, [small], [], 128) == []
    assert gone_devices(old, [small]) == ["node0/cpu1"]
    assert gone_devices(placed_on("node0", "cpu0"), [small]) == []
    roomy = node(1)  # with room: it moves to cpu0
    tries = placements_to_try(model(), CONFIG, old, [roomy], [], 128)
    assert [devices_of(p) for p in tries] == [["node0/cpu0"]]


def test_a_replica_whose_old_device_filled_up_may_go_on_another_of_its_old_devices():
    """Stages on node0 and node2; meanwhile node0 filled up (another replica healed onto
    it). Leaving out every old device from the alternative left only node1, which cannot
    hold two stages, so node0 + node2 was the only try and the restart failed until the
    budget was spent, though node1 + node2 had room (found by a probe)."""
    pp2 = common.DeploymentConfig(
        tensor_parallel=1, pipeline_parallel=2, batch_size=1, dtype=common.PRECISION_FLOAT32
    )
    fixed, block = memory_blocks(model().shape, pp2, 128)
    old = stages_on(("node0", "node2"), fixed + block)
    full = node(0.0001, node_id="node0")
    nodes = [full, node(1, node_id="node1"), node(1, node_id="node2")]
    tries = placements_to_try(model(), pp2, old, nodes, [], 128)
    assert [devices_of(p) for p in tries][0] == ["node0/cpu0", "node2/cpu0"]
    assert sorted(devices_of(tries[-1])) == ["node1/cpu0", "node2/cpu0"]
    assert len(tries) == 2


def test_replicas_waiting_to_restart_hold_no_devices_for_each_other():
    """Two pipeline replicas across node0 and node1; node1 is lost. Each counted the
    other's stale placement as taken, so neither could use node0's two devices and the
    whole deployment waited for node1 (a probe: 275 of 433 requests refused)."""
    pp2 = common.DeploymentConfig(
        tensor_parallel=1, pipeline_parallel=2, batch_size=1, dtype=common.PRECISION_FLOAT32
    )
    fixed, block = memory_blocks(model().shape, pp2, 128)
    first = stages_on(("node0", "node1"), fixed + 4 * block)
    second = common.Placement()
    second.CopyFrom(first)
    for stage in second.stages:
        stage.devices[0].device_id = "cpu1"
    deployment = deploy_pb.Deployment(
        replicas=[
            deploy_pb.Replica(index=0, state=STARTING, placement=first),
            deploy_pb.Replica(index=1, state=STARTING, placement=second),
        ]
    )
    assert held_placements(deployment, 0) == []
    lost = node(1, 1, node_id="node1")
    lost.alive = False
    nodes = [node(1, 1, node_id="node0"), lost]
    tries = placements_to_try(model(), pp2, first, nodes, held_placements(deployment, 0), 128)
    assert [sorted(devices_of(p)) for p in tries] == [["node0/cpu0", "node0/cpu1"]]
    # A replica that serves keeps its devices to itself.
    deployment.replicas[1].state = READY
    deployment.replicas[1].placement.CopyFrom(tries[0])
    assert held_placements(deployment, 0) == [tries[0]]
    assert placements_to_try(model(), pp2, first, nodes, held_placements(deployment, 0), 128) == []


def test_a_replica_back_with_its_node_does_not_share_a_device_with_another_replica():
    """Replica 1 healed onto node0's two devices while replica 0 waited for node1; when
    node1 came back, replica 0 went back to its old placement on node0/cpu0 + node1/cpu0,
    and node0/cpu0 held both (a probe, through four more losses)."""
    pp2 = common.DeploymentConfig(
        tensor_parallel=1, pipeline_parallel=2, batch_size=1, dtype=common.PRECISION_FLOAT32
    )
    fixed, block = memory_blocks(model().shape, pp2, 128)
    old = stages_on(("node0", "node1"), fixed + 4 * block)
    healed = stages_on(("node0", "node0"), fixed + 4 * block)
    healed.stages[1].devices[0].device_id = "cpu1"
    nodes = [node(1, 1, node_id="node0"), node(1, 1, node_id="node1")]
    tries = placements_to_try(model(), pp2, old, nodes, [healed], 128)
    assert tries and all(not set(devices_of(p)) & {"node0/cpu0", "node0/cpu1"} for p in tries), [
        devices_of(p) for p in tries
    ]
    assert sorted(devices_of(tries[0])) == ["node1/cpu0", "node1/cpu1"]


def test_a_node_stopped_on_purpose_is_said_to_be():
    """A planned stop (SIGTERM) of nodeb's agent read "node agent(s) nodeb do not answer
    (worker unreachable ...)", as a crash would."""
    from deploy_svc.reconciler import _stopped_heartbeating
    from services.replicas import stopped_nodes as _stopped_nodes

    stopped = node(1, node_id="node1")
    stopped.alive, stopped.stopped_at_unix_ms = False, 1
    lapsed = node(1, node_id="node2")
    lapsed.alive = False
    assert _stopped_nodes([stopped, lapsed, node(1)]) == {"node1"}
    assert _stopped_heartbeating({"node1", "node2"}, {"node1"}) == (
        "node agent(s) node2 stopped heartbeating; node agent(s) node1 stopped on purpose"
    )
    pp2 = common.DeploymentConfig(
        tensor_parallel=1, pipeline_parallel=2, batch_size=1, dtype=common.PRECISION_FLOAT32
    )
    fixed, block = memory_blocks(model().shape, pp2, 128)
    old = stages_on(("node0", "node1"), fixed + 1000 * block)
    why = waiting_for_nodes(old, [node(0.001), stopped], {})
    assert why.startswith("waiting for node(s) node1 stopped on purpose, and the live "), why


def test_a_replica_across_nodes_waits_for_a_dead_one_while_the_live_ones_cannot_hold_it():
    """Pipeline stages on node0 and node1; node1 stops heartbeating and node0 alone has
    no room for both stages. That is a wait for node1 (which may come back: an agent
    restarting), not a failed restart to spend the budget on, until node1's record is
    forgotten; a replica whose nodes all live lacks room, and its restarts count."""
    across = stages_on(("node0", "node1"), RANK_BYTES)
    dead = node(1, node_id="node1")
    dead.alive = False
    live = node(1, node_id="node0")
    why = waiting_for_nodes(across, [live, dead])
    assert why.startswith("waiting for node(s) node1: stopped heartbeating, and the live ")
    assert "no restart budget is spent meanwhile" in why
    assert waiting_for_nodes(across, [live]) == ""  # node1 forgotten: room is what lacks
    back = node(1, node_id="node1")
    assert waiting_for_nodes(across, [live, back]) == ""


# ---- the controller restarting a replica (Redis, fake agent) -----------------------------


async def settle(store: StateStore, deployment_id: str, timeout_s: float = 5.0):
    """The record once it is no longer STARTING."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = await store.get_deployment(deployment_id)
        if found.state != STARTING or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.01)


def test_a_dead_worker_is_restarted_on_its_devices_without_a_deploy(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        held = await reserved(store)
        # Hold the restart back while the state between is read: after its backoff it
        # waits for start-up reconciliation (here: until the test says it has run).
        controller.reconciled.clear()
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        now = await store.get_deployment(deployment_id)
        # Out and restarting: never READY without a worker, its memory released.
        assert now.state == STARTING and now.worker_address == ""
        assert now.state_reason == "restart 1 in 0.01 s after: worker rank 0 exited (-9)"
        assert agent.stopped == [deployment_id]
        assert set((await reserved(store)).values()) == {0}
        assert agent.started == [deployment_id]
        controller.reconciled.set()
        healed = await settle(store, deployment_id)
        assert healed.state == READY
        assert healed.state_reason == (
            "restarted 1 time(s) (1 in a row against the restart budget); last error: worker "
            "rank 0 exited (-9)"
        )
        assert healed.worker_address and healed.worker_address != dep.worker_address
        assert healed.replicas[0].worker_address == healed.worker_address
        assert devices_of(healed.placement) == devices_of(dep.placement)
        assert agent.started == [deployment_id, deployment_id]
        assert await reserved(store) == held
        await controller.remove(deployment_id)
        assert await nothing_left(store)
        assert await store.get_restarts(deployment_id) is None

    run(scenario)


class DeadWorkerAgent(FakeAgent):
    """Its StopWorkers finds rank 0 already dead, killed by a signal (the agent records
    an exit it sees at the stop, the reaper not having seen it yet)."""

    async def StopWorkers(self, request, timeout):
        await super().StopWorkers(request, timeout)
        dead = agent_pb.WorkerInfo(
            deployment_id=request.deployment_id,
            rank=0,
            state=agent_pb.WORKER_STATE_FAILED,
            exit_code=-9,
            reason="killed by SIGKILL: last line of its log",
        )
        return agent_pb.StopWorkersResponse(workers=[dead])


def test_the_cause_of_a_death_the_scheduler_reported_first_is_logged(run, caplog):
    """A worker killed mid-stream reaches the deployer as "worker unreachable"; the agent
    answers the stop with the worker's exit, which the deployer logs (a probe found the
    cause nowhere)."""

    async def scenario(store):
        controller = await controller_on(store, DeadWorkerAgent(), 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        with caplog.at_level(logging.WARNING, logger="iserve.deploy.workers"):
            assert await controller.fail(dep.deployment_id, "worker unreachable: Socket closed")
        said = [r.getMessage() for r in caplog.records if r.name == "iserve.deploy.workers"]
        assert any(
            "rank 0 had exited: killed by SIGKILL: last line of its log" in m for m in said
        ), said
        await settle(store, dep.deployment_id)
        await controller.remove(dep.deployment_id)

    run(scenario)


def test_planned_losses_restore_at_once_however_many_and_spend_no_budget(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        deployment_id = (await controller.deploy(deploy_request(1))).deployment.deployment_id
        # More stops of the stack than the budget (2) allows failures.
        for _ in range(4):
            assert await controller.fail(deployment_id, "stack stopped", planned=True)
            healed = await settle(store, deployment_id)
            assert healed.state == READY
            assert healed.state_reason == "serves again after a stop of the stack"
        record = RestartRecord.from_json(await store.get_restarts(deployment_id))
        assert (record.in_a_row, record.total) == (0, 0)
        # A real failure after them still counts from zero.
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        assert (await settle(store, deployment_id)).state_reason.startswith("restarted 1 time")
        # A stop after that failure: the restore names no failure of before.
        assert await controller.fail(deployment_id, "stack stopped", planned=True)
        healed = await settle(store, deployment_id)
        assert healed.state_reason == "serves again after a stop of the stack"
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_workers_that_outlived_their_replica_are_stopped_before_it_starts_again(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        deployment_id = (await controller.deploy(deploy_request(1))).deployment.deployment_id
        assert await controller.fail(deployment_id, "node agent(s) node0 stopped heartbeating")
        # Its agent was not answering when told to stop them: they still run (the restart
        # waits its 0.01 s backoff, and nothing was awaited since the take-out).
        agent.stale.add(deployment_id)
        healed = await settle(store, deployment_id)
        assert healed.state == READY
        assert healed.state_reason.startswith("restarted 1 time(s)")
        # Taken out (stop), the stale start refused, stopped, started: one restart spent.
        assert agent.started == [deployment_id] * 3
        assert agent.stopped == [deployment_id] * 2
        # Each stop waits as long as the agent may take: rank 0's drain and exit, then the
        # other ranks' (a remove or restart releases the memory only once they exited).
        assert min(agent.stop_timeouts) > worker_stop_s(30.0) == 70.0
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_restart_that_keeps_failing_spends_the_budget_and_fails_the_deployment(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        agent.fail_group = deployment_id
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        final = await settle(store, deployment_id)
        assert final.state == FAILED
        assert final.state_reason.startswith("gave up after 2 restart(s) in a row (at most 2)")
        assert "starting workers of" in final.state_reason
        # The deploy, then two restarts, each on its old device, then on the other.
        assert agent.started == [deployment_id] * 5
        assert set((await reserved(store)).values()) == {0}
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


class BrokenDeviceAgent(FakeAgent):
    """Workers on a device in ``broken`` fail to start (a GPU gone bad, say); on one in
    ``no_checkpoint`` they are refused as the agent refuses a checkpoint gone from its
    models root."""

    def __init__(self):
        super().__init__()
        self.broken: set[str] = set()
        self.no_checkpoint: set[str] = set()
        self.devices_tried: list[list[str]] = []

    async def StartWorkers(self, request, timeout: float):
        devices = sorted(spec.device_id for spec in request.workers)
        self.devices_tried.append(devices)
        if self.broken.intersection(devices):
            self.started.append(request.deployment_id)
            raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "worker rank 0 exited (1)")
        if self.no_checkpoint.intersection(devices):
            self.started.append(request.deployment_id)
            raise FakeRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "checkpoint_path 'tiny' is not a directory: it does not exist",
                CHECKPOINT_UNUSABLE,
            )
        return await super().StartWorkers(request, timeout)


def test_a_replica_whose_checkpoint_is_gone_is_taken_out_at_once(run):
    """Every place refuses it for its checkpoint: no restart could succeed, so it fails
    at the first (the budget, half a minute of retries, was spent before)."""

    async def scenario(store):
        agent = BrokenDeviceAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        agent.no_checkpoint.update({"cpu0", "cpu1"})
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        final = await settle(store, deployment_id)
        assert final.state == FAILED
        assert final.state_reason.startswith("not restarted: restart refused on "), final
        assert "does not exist" in final.state_reason
        assert "every restart would be refused the same way" in final.state_reason
        # The deploy, then one attempt that tried both devices.
        assert agent.started == [deployment_id] * 3
        assert set((await reserved(store)).values()) == {0}
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_checkpoint_refused_on_one_device_and_a_crash_on_the_other_is_retried(run):
    """Only a refusal everywhere is final: a worker that crashed elsewhere may start
    there next time, so the budget is spent as before."""

    async def scenario(store):
        agent = BrokenDeviceAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        agent.no_checkpoint.add("cpu0")
        agent.broken.add("cpu1")
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        final = await settle(store, deployment_id)
        assert final.state == FAILED
        assert final.state_reason.startswith("gave up after 2 restart(s) in a row"), final
        assert agent.started == [deployment_id] * 5
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_restart_that_fails_on_its_old_devices_starts_elsewhere_in_the_same_attempt(run):
    async def scenario(store):
        agent = BrokenDeviceAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        (old,) = devices_of(dep.placement)
        agent.broken.add(old.split("/")[1])
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        healed = await settle(store, deployment_id)
        # One restart: its old device refused, the other took it (before, every restart
        # tried the old device again, and the deployment failed with a device free).
        assert healed.state == READY, healed.state_reason
        assert healed.state_reason.startswith("restarted 1 time(s)")
        (new,) = devices_of(healed.placement)
        assert new != old
        assert [d[0] for d in agent.devices_tried] == [old.split("/")[1]] * 2 + [new.split("/")[1]]
        # Only the device it serves on holds memory for it.
        held = await reserved(store)
        assert held[old.split("/")[1]] == 0 and held[new.split("/")[1]] > 0
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_one_replica_restarts_while_the_other_serves(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(2))).deployment
        deployment_id = dep.deployment_id
        assert await controller.fail(f"{deployment_id}.r1", "worker rank 0 exited (-9)")
        now = await store.get_deployment(deployment_id)
        assert now.state == READY and now.worker_address == dep.worker_address
        assert [r.state for r in now.replicas] == [READY, STARTING]
        for _ in range(500):
            now = await store.get_deployment(deployment_id)
            if now.replicas[1].state == READY:
                break
            await asyncio.sleep(0.01)
        assert [r.state for r in now.replicas] == [READY, READY]
        assert devices_of(now.replicas[1].placement) == ["node0/cpu1"]
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_restart_cut_off_by_a_deployer_restart_goes_on(run):
    async def scenario(store):
        agent = FakeAgent()
        slow = RestartPolicy(first_backoff_s=60.0)
        first = await controller_on(store, agent, 2, 2, policy=slow)
        dep = (await first.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        assert await first.fail(deployment_id, "worker rank 0 exited (-9)")
        await first.close()  # the deployer dies while waiting the backoff
        assert (await store.get_deployment(deployment_id)).state == STARTING
        second = await controller_on(store, agent, 2, 2, policy=FAST)
        second.reconciled.clear()

        async def no_workers(request, timeout):

            return agent_pb.ListWorkersResponse()

        agent.ListWorkers = no_workers
        actions = await Reconciler(second, store, agent).reconcile_on_start()
        assert actions == [f"resumed restarting {deployment_id}"]
        healed = await settle(store, deployment_id)
        assert healed.state == READY
        await second.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_replica_s_restart_is_scheduled_once_whoever_asks(run):
    """After a stack restart the planned restore and the reconciler's resume each queued
    a restart of the same replica; failing, both chains spent its one budget, and it gave
    up after 10 s where the backoff promised 31 (a probe)."""

    async def scenario(store):
        agent = FakeAgent()
        slow = RestartPolicy(first_backoff_s=60.0)
        controller = await controller_on(store, agent, 2, 2, policy=slow)
        dep = (await controller.deploy(deploy_request(1))).deployment
        assert await controller.fail(dep.deployment_id, "worker rank 0 exited (-9)")
        healer = controller.healer
        assert len(healer._tasks) == 1  # waiting its 60 s backoff
        restarting = await store.get_deployment(dep.deployment_id)
        assert await healer.resume([restarting]) == [f"resumed restarting {dep.deployment_id}"]
        healer.schedule(dep.deployment_id, 0, 0.0)
        assert len(healer._tasks) == 1
        await controller.remove(dep.deployment_id)
        await controller.close()
        assert await nothing_left(store)

    run(scenario)


def test_a_replica_whose_agent_no_longer_runs_it_is_restarted(run):
    """An agent restarted on its own (or the whole stack): it answers, with no worker and
    no record of one. The replica went with its node: restarted, spending no budget. An
    agent that reports the worker FAILED (it died under a live agent) spends a step."""

    async def scenario(store):

        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        reconciler = Reconciler(controller, store, agent)

        async def not_answering(request, timeout):
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")

        agent.ListWorkers = not_answering
        assert await reconciler.check_workers() == []  # left to the heartbeat check
        assert (await store.get_deployment(deployment_id)).state == READY

        async def none_running(request, timeout):
            return agent_pb.ListWorkersResponse()

        agent.ListWorkers = none_running
        [said] = await reconciler.check_workers()
        assert said.startswith(f"failed {deployment_id}: node agent(s) ")
        assert said.endswith(
            " restarted since its workers started (they stopped with the agent), "
            "rank(s) [0] with it"
        )
        assert (await store.get_deployment(deployment_id)).state == STARTING
        healed = await settle(store, deployment_id)
        assert healed.state == READY
        assert json.loads(await store.get_restarts(deployment_id))["in_a_row"] == 0
        assert agent.started == [deployment_id, deployment_id]

        async def died(request, timeout):
            return agent_pb.ListWorkersResponse(
                workers=[
                    agent_pb.WorkerInfo(
                        deployment_id=deployment_id, state=agent_pb.WORKER_STATE_FAILED
                    )
                ]
            )

        agent.ListWorkers = died
        assert await reconciler.check_workers() == [
            f"failed {deployment_id}: its agent reports, rank(s) [0] are not running"
        ]
        await settle(store, deployment_id)
        assert json.loads(await store.get_restarts(deployment_id))["in_a_row"] == 1
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_deploy_whose_rollback_was_cut_off_is_failed_and_its_memory_released(run):
    """Its workers failed to start and the state store went away as it rolled back (a
    probe killed Redis): the record stayed STARTING and its memory reserved, for ever. The
    next workers check fails it and releases its memory; a Deploy still starting is left
    alone."""

    async def scenario(store):
        agent = FakeAgent(fail_group="")
        controller = await controller_on(store, agent, 2, policy=FAST)
        reconciler = Reconciler(controller, store, agent)
        teardown = controller.workers.teardown

        async def unreachable(deployment):
            controller.workers.teardown = teardown  # once
            raise StateStoreUnavailable("Redis unreachable (a test)")

        controller.workers.teardown = unreachable
        agent.gate = asyncio.Event()
        deploying = asyncio.create_task(controller.deploy(deploy_request(1)))
        while not agent.started:
            await asyncio.sleep(0.01)
        [cut] = await store.list_deployments()
        agent.fail_group = cut.deployment_id
        # Its Deploy is starting it: left alone.
        assert await reconciler.check_workers() == []
        agent.gate.set()
        with pytest.raises(StateStoreUnavailable):
            await deploying
        [left] = await store.list_deployments()
        assert left.state == STARTING and await store.reservation_owners()
        assert await reconciler.check_workers() == [f"failed {left.deployment_id}: {CUT_OFF}"]
        failed = await store.get_deployment(left.deployment_id)
        assert (failed.state, failed.state_reason) == (FAILED, CUT_OFF)
        assert await store.reservation_owners() == set()
        await controller.remove(left.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_deploy_cut_off_by_a_deployer_restart_is_retried_afresh_with_its_request_id(run):
    """The deployer died while a Deploy with a request id started; the one started after
    it fails that deployment. The client's retry with the same request id deploys afresh,
    as after any failed Deploy (it was answered "deployed" with the FAILED record)."""

    async def scenario(store):
        agent = FakeAgent()
        first = await controller_on(store, agent, 2, policy=FAST)
        agent.gate = asyncio.Event()
        cut = asyncio.create_task(first.deploy(deploy_request(1, request_id="retry-1")))
        while not agent.started:
            await asyncio.sleep(0.01)
        [starting] = await store.list_deployments()
        second = await controller_on(store, agent, 2, policy=FAST)  # the deployer restarted
        second.reconciled.clear()
        actions = await Reconciler(second, store, agent).reconcile_on_start()
        said = f"failed {starting.deployment_id}: the deployer restarted while the deployment was starting"
        assert said in actions
        agent.gate.set()
        retried = (await second.deploy(deploy_request(1, request_id="retry-1"))).deployment
        assert retried.deployment_id != starting.deployment_id and retried.state == READY
        await cancel_and_wait([cut])  # the first deployer's call, dead in real life
        await second.remove(retried.deployment_id)
        await second.remove(starting.deployment_id)

    run(scenario)


def test_a_remove_cut_off_midway_is_finished_by_the_next_workers_check(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        dep.state = deploy_pb.DEPLOYMENT_STATE_REMOVING  # as a Remove cut off leaves it
        await store.put_deployment(dep)
        reconciler = Reconciler(controller, store, agent)
        assert await reconciler.check_workers() == [f"finished removing {dep.deployment_id}"]
        assert await nothing_left(store)

    run(scenario)


class ReportingAgent(FakeAgent):
    """Reports what it started and not stopped, plus ``extra`` (group, rank) workers."""

    def __init__(self):
        super().__init__()
        self.extra: list[str] = []
        self.exited: list[str] = []  # groups whose worker died here, its record kept

    async def ListWorkers(self, request, timeout):

        running = [g for g in self.started if g not in self.stopped] + self.extra
        return agent_pb.ListWorkersResponse(
            workers=[
                agent_pb.WorkerInfo(deployment_id=g, rank=0, state=agent_pb.WORKER_STATE_READY)
                for g in running
            ]
            + [
                agent_pb.WorkerInfo(deployment_id=g, rank=0, state=agent_pb.WORKER_STATE_FAILED)
                for g in self.exited
            ]
        )

    async def StopWorkers(self, request, timeout):
        for kept in (self.extra, self.exited):
            if request.deployment_id in kept:
                kept.remove(request.deployment_id)
        return await super().StopWorkers(request, timeout)


class OneHungAgent(ReportingAgent):
    """node0's agent runs what it started (ReportingAgent); node1's hangs on ListWorkers (until the call's
    timeout) once ``hang`` is set, and sets ``hanging`` when such a call is under way."""

    def __init__(self):
        super().__init__()
        self.hang = asyncio.Event()
        self.hanging = asyncio.Event()
        self.node1 = types.SimpleNamespace(ListWorkers=self._node1_workers)

    def stub(self, address: str):
        return self.node1 if address == "node1:1" else self

    async def _node1_workers(self, request, timeout):

        if self.hang.is_set():
            self.hanging.set()
            await asyncio.sleep(timeout)
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return agent_pb.ListWorkersResponse()


def test_an_agent_that_hangs_holds_up_no_other_replica_s_healing(run):
    """While node1's agent takes its whole timeout (15 s) to not answer the workers check,
    a worker that died on node0 is restarted at once, not after that timeout."""

    async def scenario(store):
        agent = OneHungAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        await store.register_node(node(1, node_id="node1"), ttl_s=60)
        reconciler = Reconciler(controller, store, agent)
        controller.reconciled.clear()
        loop = asyncio.get_running_loop()
        running = loop.create_task(reconciler.run())
        try:
            await asyncio.wait_for(controller.reconciled.wait(), 10)
            agent.hang.set()
            await asyncio.wait_for(agent.hanging.wait(), 10)  # the next workers check
            await store.publish_event(
                "worker_died", deployment_id=deployment_id, rank=0, exit_code=-9, reason=""
            )
            started = loop.time()
            while agent.started.count(deployment_id) < 2:
                assert loop.time() - started < 5.0, "the restart waited for the hung agent"
                await asyncio.sleep(0.01)
            healed = await settle(store, deployment_id)
            assert healed.state == READY
            assert healed.state_reason.endswith("worker rank 0 exited (-9)")
        finally:
            await cancel_and_wait([running])
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_workers_no_deployment_holds_are_stopped_at_the_second_check_that_sees_them(run):
    """Workers that outlived their replica where the agent could not be told (a removed
    deployment's, a replica's that moved on) hold memory no longer reserved: stopped,
    once two checks in a row saw them. What a deployment holds, is starting, or a
    profiling job runs is left alone."""

    async def scenario(store):
        agent = ReportingAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        deployment_id = (await controller.deploy(deploy_request(1))).deployment.deployment_id
        starting = (await controller.deploy(deploy_request(1))).deployment.deployment_id
        reconciler = Reconciler(controller, store, agent)
        # A replica being restarted: its record says STARTING, its new workers start.
        controller.reconciled.clear()
        assert await controller.fail(starting, "worker rank 0 exited (-9)")
        agent.extra = [starting, "m-removed0", "profile-m-0"]
        assert await reconciler.check_workers() == []  # seen once: could be a race
        assert await reconciler.check_workers() == [
            "stopped workers of m-removed0 on node0: no deployment holds them"
        ]
        assert agent.extra == [starting, "profile-m-0"]
        assert deployment_id not in agent.stopped
        assert await reconciler.check_workers() == []
        controller.reconciled.set()
        assert (await settle(store, starting)).state == READY
        for done in (deployment_id, starting):
            await controller.remove(done)
        assert await nothing_left(store)

    run(scenario)


def test_workers_are_left_alone_when_redis_lost_its_records(run, caplog):
    """FLUSHALL under a running stack: every worker looked unheld, and the deployer
    stopped them all within seconds, a warning per group its only trace (a tester). The
    missing state-format key tells a Redis that lost its records: nothing is stopped, and
    an ERROR says why."""
    from services.state import keys

    async def scenario(store):
        agent = ReportingAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        deployment_id = (await controller.deploy(deploy_request(1))).deployment.deployment_id
        reconciler = Reconciler(controller, store, agent)
        await store.redis.flushdb()  # the records and the state-format key gone
        await store.register_node(node(2, 2), ttl_s=60)  # the agent's next heartbeat
        agent.extra = ["m-removed0"]
        with caplog.at_level(logging.ERROR, logger="iserve.deploy"):
            for _ in range(3):
                assert await reconciler.check_workers() == []
        assert "lost its records" in caplog.text
        assert deployment_id not in agent.stopped and "m-removed0" not in agent.stopped
        # Claimed again (a restored backup, a restarted stack): unheld workers stop.
        await store.claim_state_format()
        assert await reconciler.check_workers() == []
        assert f"stopped workers of {deployment_id} on node0: no deployment holds them" in (
            await reconciler.check_workers()
        )
        assert not await store.redis.exists(keys.deployment(deployment_id))

    run(scenario)


def test_worker_records_of_no_deployment_are_forgotten_at_the_second_check(run):
    """An agent wrote a record after its deployment was gone (a start cancelled by a
    deploy that failed on another node; a hung agent that resumed after a remove): it
    stayed in Redis for good (a probe). Forgotten once two checks saw it; the records
    of a deployment, of its replicas and of a profiling job stay."""

    async def scenario(store):
        agent = ReportingAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        deployment_id = (await controller.deploy(deploy_request(2))).deployment.deployment_id
        reconciler = Reconciler(controller, store, agent)
        failed = agent_pb.WorkerInfo(rank=1, state=agent_pb.WORKER_STATE_FAILED)
        for group in ("m-gone0", "m-gone0.r1", "profile-m-0", deployment_id, f"{deployment_id}.r1"):
            failed.deployment_id = group
            await store.put_worker(failed)
        assert await reconciler.check_workers() == []  # seen once: could be a race
        assert await reconciler.check_workers() == [
            "forgot the worker records of m-gone0: no deployment has them",
            "forgot the worker records of m-gone0.r1: no deployment has them",
        ]
        assert await store.worker_groups() == {"profile-m-0", deployment_id, f"{deployment_id}.r1"}
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_node_dead_for_longer_than_the_setting_is_forgotten(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        gone = node(1, node_id="node1")
        await store.register_node(gone, ttl_s=0.05)
        await store.publish_devices("node1", gone.devices, ttl_s=0.05)
        reconciler = Reconciler(controller, store, agent)
        await asyncio.sleep(0.3)  # its heartbeat lapsed 0.25 s ago
        controller.settings.node_forget_after_s = 0  # listed for ever
        await reconciler.check_nodes()
        controller.settings.node_forget_after_s = 60.0
        await reconciler.check_nodes()
        assert [(n.node_id, n.alive) for n in await store.list_nodes()] == [
            ("node0", True),
            ("node1", False),
        ]
        controller.settings.node_forget_after_s = 0.1
        await reconciler.check_nodes()
        assert [n.node_id for n in await store.list_nodes()] == ["node0"]

    run(scenario)


def test_a_late_report_about_a_worker_replaced_since_fails_nothing(run):
    """A scheduler that cached the address of the worker before a restart reports it
    unreachable, or an agent cut off while the replica moved reports its old worker
    dead: the replica that replaced it keeps serving. (A stack stopped and started lost
    its restored replica so, as the scheduler tried the old address first.)"""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id, old_address = dep.deployment_id, dep.worker_address
        assert await controller.fail(deployment_id, "stack stopped", planned=True)
        healed = await settle(store, deployment_id)
        assert healed.state == READY and healed.worker_address != old_address
        reconciler = Reconciler(controller, store, agent)
        late = [
            {"kind": "worker_unreachable", "worker_address": old_address, "reason": "refused"},
            {"kind": "worker_died", "node_id": "node9", "rank": 0, "exit_code": -9},
        ]
        for event in late:
            await reconciler.handle({**event, "deployment_id": deployment_id})
        now = await store.get_deployment(deployment_id)
        assert now.state == READY and now.worker_address == healed.worker_address
        assert agent.started == [deployment_id, deployment_id]
        # About the worker it has now: taken out and restarted (the fake address answers
        # no health check).
        await reconciler.handle(
            {
                "kind": "worker_unreachable",
                "deployment_id": deployment_id,
                "worker_address": healed.worker_address,
            }
        )
        assert (await store.get_deployment(deployment_id)).state == STARTING
        assert (await settle(store, deployment_id)).state == READY
        await reconciler.handle(
            {"kind": "worker_died", "deployment_id": deployment_id, "node_id": "node0", "rank": 0}
        )
        assert (await store.get_deployment(deployment_id)).state == STARTING
        assert (await settle(store, deployment_id)).state == READY
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_worker_lost_with_its_agent_before_the_heartbeat_lapses_spends_no_budget(run):
    """The scheduler finds a worker gone (or a pipeline's surviving rank its peer) at
    once; the node's heartbeat lapses seconds later. Counted as the worker's fault, node
    losses spent the budget (a probe: 3 of 5 steps in four losses of one node)."""

    class AgentGone(FakeAgent):
        answering = True
        # The agent lived through its worker's death: it keeps the worker's record.
        kept_record = False

        async def ListWorkers(self, request, timeout: float):
            if not self.answering:
                raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Connection refused")
            if self.kept_record:
                failed = agent_pb.WorkerInfo(
                    deployment_id=request.deployment_id, state=agent_pb.WORKER_STATE_FAILED
                )
                return agent_pb.ListWorkersResponse(workers=[failed])
            return await super().ListWorkers(request, timeout)

    async def scenario(store):
        agent = AgentGone()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        reconciler = Reconciler(controller, store, agent)
        event = {"kind": "worker_unreachable", "deployment_id": dep.deployment_id}
        for _ in range(FAST.max_restarts + 1):
            agent.answering = False
            address = (await store.get_deployment(dep.deployment_id)).worker_address
            await reconciler.handle({**event, "worker_address": address})
            taken_out = await store.get_deployment(dep.deployment_id)
            assert taken_out.state_reason.startswith(
                "restart now after: node agent(s) node0 do not answer (worker unreachable"
            ), taken_out.state_reason
            agent.answering = True
            controller.workers.reach.answered("node0:1")
            assert (await settle(store, dep.deployment_id)).state == READY
        assert (await controller.healer.record_of(dep.deployment_id)).in_a_row == 0
        # Its agent answering with the dead worker's record, the worker's loss is the
        # worker's: the budget counts it.
        agent.kept_record = True
        address = (await store.get_deployment(dep.deployment_id)).worker_address
        await reconciler.handle({**event, "worker_address": address})
        assert (await controller.healer.record_of(dep.deployment_id)).in_a_row == 1
        await settle(store, dep.deployment_id)
        await controller.remove(dep.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_replica_whose_only_node_is_dead_waits_for_it_spending_no_budget(run, monkeypatch):
    """A single-node stack whose agent is down for a while (killed, or stopped): its
    replicas cannot start anywhere. The restarts used to fail one after another ("no
    live devices with room") and spend the whole budget within half a minute, leaving
    every deployment FAILED for good. They wait for the node instead, saying so, and
    start once it is back."""
    from deploy_svc import healer
    from services.state import keys

    monkeypatch.setattr(healer, "NODE_WAIT_POLL_S", 0.01)

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id

        async def listed_on_devices() -> list[str]:
            state = await controller.cluster_state()
            return [i for n in state.nodes for d in n.devices for i in d.deployment_ids]

        assert await listed_on_devices() == [deployment_id]
        await store.redis.delete(keys.node_heartbeat("node0"))  # the agent is gone
        assert await controller.fail(deployment_id, "node agent(s) node0 stopped heartbeating")
        await asyncio.sleep(0.5)  # dozens of polls, far beyond FAST's two restarts
        waiting = await store.get_deployment(deployment_id)
        assert waiting.state == STARTING
        # It holds no memory while it waits, so `iserve status` shows it on no device.
        assert await listed_on_devices() == []
        assert waiting.replicas[0].state_reason == (
            "waiting for a live node with cpu devices: node(s) node0 stopped heartbeating; "
            "it starts again once one is back (no restart budget is spent meanwhile)"
        )
        # What the CLI and the gateway's 503 show: the wait, not the first restart's note.
        assert waiting.state_reason == waiting.replicas[0].state_reason
        record = await controller.healer.record_of(deployment_id)
        assert record.in_a_row == 1  # the node's loss itself, nothing more
        await store.register_node(node(2), ttl_s=60)  # the agent is back
        served = await settle(store, deployment_id)
        assert served.state == READY, served.state_reason
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_dead_nodes_devices_show_nothing_free(run):
    """Its last figures stay (what it held when it stopped), but nothing can be placed
    there: a reader of the cluster state must not count its free bytes."""
    from services.state import keys

    async def scenario(store):
        controller = await controller_on(store, FakeAgent(), 2, 2)
        [before] = (await controller.cluster_state()).nodes
        assert before.alive and all(d.free_bytes > 0 for d in before.devices)
        await store.redis.delete(keys.node_heartbeat("node0"))
        [dead] = (await controller.cluster_state()).nodes
        assert not dead.alive
        assert [d.free_bytes for d in dead.devices] == [0, 0]
        assert [d.total_bytes for d in dead.devices] == [d.total_bytes for d in before.devices]

    run(scenario)


class UnreachableAgent(FakeAgent):
    """An agent that heartbeats to Redis but that the deployer cannot reach while
    ``reachable`` is False (its certificate from another CA, a firewalled port)."""

    def __init__(self):
        super().__init__()
        self.reachable = True
        self.refused = 0

    async def StartWorkers(self, request, timeout: float):
        if not self.reachable:
            self.refused += 1
            raise FakeRpcError(
                grpc.StatusCode.UNAVAILABLE,
                "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                "Tls handshake failed (TSI_PROTOCOL_FAILURE): CERTIFICATE_VERIFY_FAILED",
            )
        return await super().StartWorkers(request, timeout)


def test_a_node_whose_agent_does_not_answer_holds_a_restart_spending_no_budget(run, monkeypatch):
    """The node heartbeats, so it counted as live: every restart was placed on it and
    failed UNAVAILABLE, and the budget was spent in seconds (the deployment FAILED for
    good, though the agent's certificate was all that was wrong). After the first such
    failure the node counts as not alive until its agent answers (the reconciler asks it
    every few seconds): the restart waits, saying why, and nothing is placed there."""
    from deploy_svc import healer

    monkeypatch.setattr(healer, "NODE_WAIT_POLL_S", 0.01)

    async def scenario(store):
        agent = UnreachableAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        deployment_id = dep.deployment_id
        [listed] = await store.list_nodes()
        agent.reachable = False
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        await asyncio.sleep(0.5)  # dozens of polls, far beyond FAST's two restarts
        waiting = await store.get_deployment(deployment_id)
        assert waiting.state == STARTING, waiting.state_reason
        assert agent.refused == 1  # the one try that found it unreachable
        reason = waiting.replicas[0].state_reason
        assert reason.startswith(
            "waiting for a live node with cpu devices: node node0: its agent does not "
            "answer (failed to connect to all addresses;"
        ), reason
        assert "no restart budget is spent meanwhile" in reason
        record = await controller.healer.record_of(deployment_id)
        assert record.in_a_row == 2  # the worker's death and the one failed try
        state = await controller.cluster_state()
        assert [n.alive for n in state.nodes] == [False]  # `iserve status` says so
        with pytest.raises(IServeError):  # and no deployment is placed there
            await controller.deploy(deploy_request(1))
        agent.reachable = True
        controller.workers.reach.answered(listed.agent_address)  # the reconciler's call
        served = await settle(store, deployment_id)
        assert served.state == READY, served.state_reason
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_the_reachability_of_agents_is_by_address_and_answering_clears_it():
    reach = Reachability()
    live, other = node(1, node_id="node0"), node(1, node_id="node1")
    live.agent_address, other.agent_address = "10.0.0.1:50064", "10.0.0.2:50064"
    reach.unreachable("10.0.0.1:50064", "Tls handshake failed\n  (TSI_PROTOCOL_FAILURE)")
    assert reach.unanswered([live, other]) == {
        "node0": "Tls handshake failed (TSI_PROTOCOL_FAILURE)"
    }
    assert [n.alive for n in reach.usable([live, other])] == [False, True]
    # `iserve status` says why, not "dead" of a node heartbeating a moment ago.
    assert [n.unreachable for n in reach.usable([live, other])] == [
        "Tls handshake failed (TSI_PROTOCOL_FAILURE)",
        "",
    ]
    assert live.alive and not live.unreachable  # the records given are not changed
    moved = node(1, node_id="node0")
    moved.agent_address = "10.0.0.1:50099"  # restarted on another port: a fresh chance
    assert reach.usable([moved])[0].alive and reach.unanswered([moved]) == {}
    reach.answered("10.0.0.1:50064")
    assert reach.usable([live])[0].alive
    across = stages_on(("node0", "node1"), RANK_BYTES)
    reach.unreachable("10.0.0.2:50064", "Connection refused")
    why = waiting_for_nodes(across, reach.usable([live, other]), reach.unanswered([other]))
    assert why.startswith(
        "waiting for node node1: its agent does not answer (Connection refused), and the live"
    ), why


def test_an_agent_back_after_its_heartbeat_lapsed_is_tried_afresh():
    """A mark made as the agent died ("connection refused") kept the new agent, already
    listening on the same address, out of placement with that stale reason until the
    reconciler's next call reached it."""
    reach = Reachability()
    alive = node(1, node_id="nodeb")
    alive.agent_address = "10.0.0.2:50064"
    reach.unreachable("10.0.0.2:50064", "failed to connect: Connection refused")
    assert not reach.usable([alive])[0].alive  # before its heartbeat lapses: out
    lapsed = common.NodeState()
    lapsed.CopyFrom(alive)
    lapsed.alive = False
    reach.usable([lapsed])  # seen without a heartbeat
    assert reach.usable([alive])[0].alive and reach.unanswered([alive]) == {}
    reach.unreachable("10.0.0.2:50064", "failed to connect: Connection refused")
    reach.forget_lapsed([lapsed])  # the reconciler's listing, which skips dead nodes
    assert reach.unanswered([alive]) == {}


def test_replicas_lost_with_their_nodes_come_back_however_many(run):
    """A correlated loss (a rack's nodes at once) failed every replica past the budget
    for good, though each had room elsewhere: a node lost is no fault of the replica."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        for _ in range(FAST.max_restarts + 2):
            assert await controller.fail(
                dep.deployment_id, "node agent(s) node9 stopped heartbeating", lost_rank=True
            )
            served = await settle(store, dep.deployment_id)
            assert served.state == READY, served.state_reason
        assert served.state_reason == (
            f"restarted {FAST.max_restarts + 2} time(s) (none in a row against the restart "
            "budget); last error: node agent(s) node9 stopped heartbeating"
        )
        record = await controller.healer.record_of(dep.deployment_id)
        assert record.in_a_row == 0
        # A worker's own death still spends it.
        assert await controller.fail(dep.deployment_id, "worker exited with code 1")
        assert (await controller.healer.record_of(dep.deployment_id)).in_a_row == 1
        await settle(store, dep.deployment_id)
        await controller.remove(dep.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_the_replicas_of_a_dead_node_are_taken_out_side_by_side(run):
    """One replica whose stop takes long (its group's rank on a live node cannot drain)
    held every other replica of the dead node in service, routed to, for its whole stop
    (a multi-host probe: 41 s)."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=FAST)
        first = (await controller.deploy(deploy_request(1))).deployment
        second = (await controller.deploy(deploy_request(1))).deployment
        stop_on = controller.workers.stop_on

        async def slow_for_the_first(node_ids, group, **options):
            if group.startswith(first.deployment_id):
                await asyncio.sleep(2.0)
            await stop_on(node_ids, group, **options)

        controller.workers.stop_on = slow_for_the_first
        lapsed = node(2, 2)
        await store.register_node(lapsed, ttl_s=0.05)
        await store.publish_devices("node0", lapsed.devices, ttl_s=0.05)
        await asyncio.sleep(0.3)  # node0's heartbeat lapsed
        reconciler = Reconciler(controller, store, agent)
        checking = asyncio.create_task(reconciler.check_nodes())
        await asyncio.sleep(0.8)
        assert not checking.done()  # the first one's stop still runs
        taken_out = await store.get_deployment(second.deployment_id)
        assert not any(r.state == READY for r in taken_out.replicas), taken_out
        await checking

    run(scenario)


def test_a_moved_replica_whose_room_another_took_first_waits_spending_no_budget(run, monkeypatch):
    """A dead node's replicas are moved at once, side by side: the second found room that
    the first reserved a moment later, its reservation was refused, and that counted
    against the budget (a tester: 3 in a row from one node loss). While the dead node
    may come back it waits for room, as it would had the other reserved first."""
    from deploy_svc import healer
    from services.state import keys
    from services.state.store import ReservationError

    monkeypatch.setattr(healer, "NODE_WAIT_POLL_S", 0.01)

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        dep = (await controller.deploy(deploy_request(1))).deployment
        await store.register_node(node(2, node_id="node1"), ttl_s=60)
        await store.redis.delete(keys.node_heartbeat("node0"))  # node0 stopped
        reserve, refusals = store.reserve, []

        async def taken_first(group, need, *args, **kwargs):
            if not refusals:  # the other replica of the loss got there first, once
                refusals.append(group)
                raise ReservationError("device node1/cpu0 has 0 MiB free, 551 MiB needed")
            return await reserve(group, need, *args, **kwargs)

        store.reserve = taken_first
        assert await controller.fail(
            dep.deployment_id, "node agent(s) node0 stopped heartbeating", lost_rank=True
        )
        served = await settle(store, dep.deployment_id)
        assert refusals and served.state == READY, served.state_reason
        assert [d.node_id for s in served.replicas[0].placement.stages for d in s.devices] == [
            "node1"
        ]
        assert (await controller.healer.record_of(dep.deployment_id)).in_a_row == 0
        await controller.remove(dep.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_exited_workers_no_deployment_holds_are_cleared_at_the_second_check(run):
    """A deployment removed while its node's agent was frozen: its workers exited there,
    and the agent kept their records, ports and ready files for good, since only live
    workers were ever stopped as unheld (a tester). What a deployment holds is left."""

    async def scenario(store):
        agent = ReportingAgent()
        controller = await controller_on(store, agent, 2, policy=FAST)
        deployment_id = (await controller.deploy(deploy_request(1))).deployment.deployment_id
        reconciler = Reconciler(controller, store, agent)
        agent.exited = ["m-removed0", deployment_id]  # its own dead rank: the healer's
        assert await reconciler.check_workers() == []
        assert await reconciler.check_workers() == [
            "cleared exited workers of m-removed0 on node0: no deployment holds them"
        ]
        assert agent.exited == [deployment_id]
        assert await reconciler.check_workers() == []
        agent.exited = []
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)
