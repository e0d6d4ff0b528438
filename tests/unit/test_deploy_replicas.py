"""Deploying replicas: where they go (deploy_svc.planning.replica_placements, pure) and
the controller's all-or-nothing launch, take-out and removal against a real Redis with
fake agents and estimator (no server)."""

from __future__ import annotations

import asyncio
import math
import types

import grpc
import pytest

from deploy_svc import planning
from deploy_svc.controller import REMOVING_REASON, DeploymentController, DeploymentRemoved
from deploy_svc.explicit import ExplicitPlan
from deploy_svc.healing import RestartPolicy
from deploy_svc.reconciler import Reconciler
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.errors import (
    REASON_KEY,
    FailedPrecondition,
    InvalidArgument,
    IServeError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.reservation import memory_blocks

GIB = 1 << 30
MIB = 1 << 20
READY = deploy_pb.DEPLOYMENT_STATE_READY
REMOVING = deploy_pb.DEPLOYMENT_STATE_REMOVING
FAILED = deploy_pb.DEPLOYMENT_STATE_FAILED
EXPLICIT = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1)


def model() -> model_pb.Model:
    m = model_pb.Model(
        model_id="m",
        checkpoint_path="m",
        state=model_pb.MODEL_STATE_PROFILED,
        shape=model_pb.ModelShape(
            num_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=16,
            hidden_size=64,
            intermediate_size=128,
            vocab_size=1000,
            max_position_embeddings=2048,
            parameter_count=300_000,
            weight_bytes=1_200_000,
            dtype=common.PRECISION_FLOAT32,
        ),
    )
    m.variants.add(name="fp32", weight_quant=common.WEIGHT_QUANT_NONE)
    return m


def node(*free_gib: float, node_id: str = "node0") -> common.NodeState:
    return common.NodeState(
        node_id=node_id,
        alive=True,
        agent_address=f"{node_id}:1",
        devices=[
            common.DeviceState(
                ref=common.DeviceRef(node_id=node_id, device_id=f"cpu{i}"),
                hardware_type="cpu",
                total_bytes=int(f * GIB),
                free_bytes=int(f * GIB),
            )
            for i, f in enumerate(free_gib)
        ],
    )


def devices_of(placement: common.Placement) -> list[str]:
    return [f"{d.node_id}/{d.device_id}" for s in placement.stages for d in s.devices]


# ---- planning.replica_placements (pure) ------------------------------------------------


def prepared_for(nodes, config=EXPLICIT, policy="hybrid") -> planning.Prepared:
    limits = ExplicitPlan(config, 64, 64)
    return planning.Prepared(
        model(),
        limits,
        policy,
        False,
        [planning.Option(1, config)],
        None,
        "",
        nodes,
        common.ServiceObjectives(),
        False,
    )


def test_each_replica_gets_devices_of_its_own_and_the_same_memory():
    nodes = [node(4, 4, 4)]
    prepared = prepared_for(nodes, policy="packing")  # packing would stack them if allowed
    decision = planning.decide_on(prepared, nodes)
    more = planning.replica_placements(prepared, decision, nodes, 3)
    used = [devices_of(p) for p in [decision.placement, *more]]
    assert sorted(d for ds in used for d in ds) == ["node0/cpu0", "node0/cpu1", "node0/cpu2"]
    reserved = {tuple(s.reserved_bytes) for p in more for s in p.stages}
    assert reserved == {tuple(decision.placement.stages[0].reserved_bytes)}


def test_one_replica_places_nothing_more():
    nodes = [node(4)]
    prepared = prepared_for(nodes)
    decision = planning.decide_on(prepared, nodes)
    assert planning.replica_placements(prepared, decision, nodes, 1) == []


def test_replicas_beyond_the_devices_name_the_replica_without_room():
    nodes = [node(4, 4)]
    prepared = prepared_for(nodes)
    decision = planning.decide_on(prepared, nodes)
    with pytest.raises(ResourceExhausted) as failure:
        planning.replica_placements(prepared, decision, nodes, 3)
    assert str(failure.value).startswith("replica 3 of 3 of m (tp=1 pp=1 batch=1")
    assert "0 device(s) not taken by the other replicas, tp=1 x pp=1 needs 1" in str(failure.value)


def test_a_device_too_small_for_a_replica_is_explained():
    nodes = [node(4, 0.1)]
    prepared = prepared_for(nodes)
    decision = planning.decide_on(prepared, nodes)
    with pytest.raises(ResourceExhausted, match=r"^replica 2 of 2 of m .*MiB"):
        planning.replica_placements(prepared, decision, nodes, 2)


def test_pipeline_replicas_keep_their_stage_memory():
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2)
    nodes = [node(4, 4, 4, 4)]
    prepared = prepared_for(nodes, config)
    decision = planning.decide_on(prepared, nodes)
    [second] = planning.replica_placements(prepared, decision, nodes, 2)
    assert len(second.stages) == 2
    assert not set(devices_of(second)) & set(devices_of(decision.placement))
    fixed, block = memory_blocks(model().shape, decision.config, 128)
    assert [s.reserved_bytes[0] for s in second.stages] == [fixed + block, fixed + block]


# ---- the controller against Redis -------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, reason: str = ""):
        self._code, self._details, self._reason = code, details, reason

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REASON_KEY, self._reason),) if self._reason else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeAgent:
    """StartWorkers answers with one address per rank, or fails for ``fail_group``; a
    group in ``stale`` still has workers (ALREADY_EXISTS, as the real agent answers)
    until StopWorkers stops them."""

    def __init__(self, fail_group: str = ""):
        self.fail_group = fail_group
        self.stale: set[str] = set()
        self.stop_timeouts: list[float] = []
        self.gate: asyncio.Event | None = None  # StartWorkers waits for it when set
        self.stop_gate: asyncio.Event | None = None  # and StopWorkers for this one
        self.started: list[str] = []
        self.engines: list[int] = []
        self.stopped: list[str] = []
        self._port = 6000

    def stub(self, address: str) -> FakeAgent:
        return self

    async def close(self) -> None:
        pass

    async def StartWorkers(self, request: agent_pb.StartWorkersRequest, timeout: float):
        self.started.append(request.deployment_id)
        self.engines.append(request.engine)
        if self.gate is not None:
            await self.gate.wait()
        if request.deployment_id == self.fail_group:
            raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "worker rank 0 exited (1)")
        if request.deployment_id in self.stale:
            raise FakeRpcError(grpc.StatusCode.ALREADY_EXISTS, "already has workers")
        workers = []
        for spec in request.workers:
            self._port += 1
            workers.append(
                agent_pb.WorkerInfo(
                    deployment_id=request.deployment_id,
                    rank=spec.rank,
                    address=f"127.0.0.1:{self._port}",
                )
            )
        return agent_pb.StartWorkersResponse(workers=workers)

    async def ListWorkers(self, request: agent_pb.ListWorkersRequest, timeout: float):
        return agent_pb.ListWorkersResponse()

    async def StopWorkers(self, request: agent_pb.StopWorkersRequest, timeout: float):
        self.stopped.append(request.deployment_id)
        if self.stop_gate is not None:  # a drain under way
            await self.stop_gate.wait()
        self.stop_timeouts.append(timeout)
        self.stale.discard(request.deployment_id)
        return agent_pb.StopWorkersResponse()


class FakeEstimator:
    """Ranks ``ranked`` for an intent; estimates nothing at a batch size."""

    def __init__(self, ranked: list[estimator_pb.RankedConfig] | None = None):
        self.ranked = ranked or []

    async def RankConfigs(self, request, timeout: float):
        return estimator_pb.RankConfigsResponse(ranked=self.ranked)

    async def EstimateConfigs(self, request, timeout: float):
        raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "not profiled")


async def controller_on(
    store, agent: FakeAgent, *free_gib: float, estimator=None, policy: RestartPolicy | None = None
):
    await store.create_model(model())
    await store.register_node(node(*free_gib), ttl_s=60)
    settings = types.SimpleNamespace(ready_timeout_s=5.0, drain_timeout_s=30.0)
    controller = DeploymentController(settings, store, agent, policy)
    controller._estimator = estimator or FakeEstimator()
    controller.reconciled.set()
    return controller


async def reserved(store) -> dict[str, int]:
    return {d.ref.device_id: d.reserved_bytes for n in await store.list_nodes() for d in n.devices}


async def nothing_left(store) -> bool:
    return (
        await store.list_deployments() == []
        and await store.reservation_owners() == set()
        and set((await reserved(store)).values()) == {0}
    )


def deploy_request(replicas: int, **fields) -> deploy_pb.DeployRequest:
    fields.setdefault("config", EXPLICIT)
    fields.setdefault("model_id", "m")
    return deploy_pb.DeployRequest(replicas=replicas, **fields)


def test_two_replicas_start_on_two_devices_and_remove_stops_both(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        reply = await controller.deploy(deploy_request(2))
        dep = reply.deployment
        group1 = f"{dep.deployment_id}.r1"
        assert [(r.index, r.state) for r in dep.replicas] == [(0, READY), (1, READY)]
        assert dep.replicas[0].worker_address != dep.replicas[1].worker_address
        assert dep.worker_address == dep.replicas[0].worker_address
        assert devices_of(dep.replicas[0].placement) == ["node0/cpu0"]
        assert devices_of(dep.replicas[1].placement) == ["node0/cpu1"]
        assert [devices_of(p) for p in reply.decision.replica_placements] == [["node0/cpu1"]]
        assert sorted(agent.started) == sorted([dep.deployment_id, group1])
        # Each node chooses the engine (its ISERVE_ENGINE): the deployer names none.
        assert agent.engines == [agent_pb.ENGINE_KIND_UNSPECIFIED] * 2
        assert await store.reservation_owners() == {dep.deployment_id, group1}
        assert await store.get_deployment(dep.deployment_id) == dep
        await controller.remove(dep.deployment_id)
        assert sorted(agent.stopped) == sorted([dep.deployment_id, group1])
        assert await nothing_left(store)

    run(scenario)


def test_more_replicas_than_devices_is_resource_exhausted_and_starts_nothing(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        with pytest.raises(ResourceExhausted, match=r"^replica 3 of 3 of m "):
            await controller.deploy(deploy_request(3, request_id="req-3"))
        assert agent.started == []
        assert await nothing_left(store)
        # The request id is free again: the same request may be retried.
        assert await store.claim_deploy_request("req-3", "x") is None

    run(scenario)


def test_more_than_sixteen_replicas_is_invalid_and_changes_nothing(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        with pytest.raises(InvalidArgument, match="replicas must be at most 16, got 17"):
            await controller.deploy(deploy_request(17))
        with pytest.raises(InvalidArgument, match="replicas must be at most 16, got 17"):
            await controller.plan(deploy_pb.PlanDeploymentRequest(model_id="m", replicas=17))
        assert agent.started == []
        assert await nothing_left(store)

    run(scenario)


def test_a_malformed_intent_beside_a_configuration_is_invalid_and_changes_nothing(run):
    """The intent goes unused beside an explicit configuration, but a NaN target in it
    was taken in silence (a fuzzing tester); a well-formed one is still fine there."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        bad = common.Intent(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=math.nan)
        with pytest.raises(InvalidArgument, match="needs a positive latency_slo_ms"):
            await controller.deploy(deploy_request(1, intent=bad))
        with pytest.raises(InvalidArgument, match="needs a positive latency_slo_ms"):
            await controller.plan(
                deploy_pb.PlanDeploymentRequest(model_id="m", config=EXPLICIT, intent=bad)
            )
        assert agent.started == []
        assert await nothing_left(store)
        good = common.Intent(kind=common.INTENT_KIND_MIN_LATENCY)
        reply = await controller.deploy(deploy_request(1, intent=good))
        assert reply.deployment.config.tensor_parallel == EXPLICIT.tensor_parallel
        # The decision says the intent went unused.
        assert reply.decision.note.startswith(
            "explicit configuration (the intent, MIN_LATENCY, is not used)"
        ), reply.decision.note

    run(scenario)


def test_a_replica_that_fails_to_start_tears_down_the_others(run):
    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, 2)
        agent.fail_group = "pending"

        async def start(request, timeout):
            if request.deployment_id.endswith(".r2"):
                agent.fail_group = request.deployment_id
            return await FakeAgent.StartWorkers(agent, request, timeout)

        agent.StartWorkers = start
        with pytest.raises(IServeError, match=r"starting workers of m-\w+\.r2") as failure:
            await controller.deploy(deploy_request(3))
        assert failure.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert len(agent.started) == 3
        assert sorted(agent.stopped) == sorted(agent.started)  # every replica stopped
        assert await nothing_left(store)

    run(scenario)


NO_RESTARTS = RestartPolicy(max_restarts=0)
GAVE_UP = "gave up after 0 restart(s) in a row (at most 0); last error: "


def test_with_no_restarts_left_a_dead_replica_is_taken_out_and_the_last_one_fails_all(run):
    """(Restarts themselves: tests/unit/test_deploy_healing.py.)"""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=NO_RESTARTS)
        dep = (await controller.deploy(deploy_request(2))).deployment
        deployment_id = dep.deployment_id
        assert await controller.fail(deployment_id, "worker rank 0 exited (-9)")
        now = await store.get_deployment(deployment_id)
        assert now.state == READY
        assert [(r.state, r.state_reason) for r in now.replicas] == [
            (FAILED, GAVE_UP + "worker rank 0 exited (-9)"),
            (READY, ""),
        ]
        # The record now points at the replica that serves.
        assert now.worker_address == dep.replicas[1].worker_address
        assert devices_of(now.placement) == ["node0/cpu1"]
        assert agent.stopped == [deployment_id]
        assert await store.reservation_owners() == {f"{deployment_id}.r1"}
        assert (await reserved(store))["cpu0"] == 0
        # Out already: a second report of the same replica changes nothing.
        assert not await controller.fail(deployment_id, "again")
        assert await controller.fail(f"{deployment_id}.r1", "worker rank 0 exited (-9)")
        now = await store.get_deployment(deployment_id)
        assert now.state == FAILED
        assert [r.state for r in now.replicas] == [FAILED, FAILED]
        assert await store.reservation_owners() == set()
        await controller.remove(deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_plan_places_every_replica_or_names_the_one_without_room(run):
    async def scenario(store):
        controller = await controller_on(store, FakeAgent(), 2, 2)
        decision = await controller.plan(
            deploy_pb.PlanDeploymentRequest(model_id="m", config=EXPLICIT, replicas=2)
        )
        assert devices_of(decision.placement) == ["node0/cpu0"]
        assert [devices_of(p) for p in decision.replica_placements] == [["node0/cpu1"]]
        with pytest.raises(ResourceExhausted, match="^replica 3 of 3 of m"):
            await controller.plan(
                deploy_pb.PlanDeploymentRequest(model_id="m", config=EXPLICIT, replicas=3)
            )
        assert await nothing_left(store)

    run(scenario)


def test_an_intent_falls_back_to_a_configuration_whose_replicas_all_fit(run):
    """#1 fits the big device only; #2 is small enough for a replica on each."""

    def ranked(rank: int, weight_quant: int, memory_gib: float) -> estimator_pb.RankedConfig:
        config = common.DeploymentConfig(
            tensor_parallel=1, pipeline_parallel=1, weight_quant=weight_quant, batch_size=1
        )
        estimate = estimator_pb.ConfigEstimate(
            config=config, memory_total_bytes=int(memory_gib * GIB)
        )
        return estimator_pb.RankedConfig(rank=rank, estimate=estimate, meets_intent=True)

    async def scenario(store):
        agent = FakeAgent()
        estimator = FakeEstimator(
            [ranked(1, common.WEIGHT_QUANT_NONE, 2.0), ranked(2, common.WEIGHT_QUANT_INT8, 0.2)]
        )
        controller = await controller_on(store, agent, 4, 1, estimator=estimator)
        reply = await controller.deploy(
            deploy_pb.DeployRequest(
                model_id="m", intent=common.Intent(kind=common.INTENT_KIND_MIN_COST), replicas=2
            )
        )
        assert reply.decision.winner_rank == 2
        [skipped] = reply.decision.skipped
        assert skipped.rank == 1 and skipped.reason.startswith("replica 2 of 2 of m")
        assert len(reply.deployment.replicas) == 2
        assert agent.started == [reply.deployment.deployment_id, agent.started[1]]
        await controller.remove(reply.deployment.deployment_id)
        assert await nothing_left(store)

    run(scenario)


@pytest.mark.parametrize("reason", ["checkpoint_unusable", ""])
def test_a_checkpoint_every_configuration_loads_ends_the_intent_deploy_at_once(run, reason):
    """The agent refuses the model's own checkpoint for good (rewritten since it was
    registered): the next configurations load it too, so none is tried. Any other
    launch failure goes on to the next (a tester saw 11 starts for one such checkpoint)."""

    def ranked(rank: int, weight_quant: int) -> estimator_pb.RankedConfig:
        config = common.DeploymentConfig(
            tensor_parallel=1, pipeline_parallel=1, weight_quant=weight_quant, batch_size=1
        )
        estimate = estimator_pb.ConfigEstimate(config=config, memory_total_bytes=GIB // 10)
        return estimator_pb.RankedConfig(rank=rank, estimate=estimate, meets_intent=True)

    async def scenario(store):
        agent = FakeAgent()

        async def refuse(request, timeout):
            agent.started.append(request.deployment_id)
            raise FakeRpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "checkpoint 'm' is no longer the model registered from it: tensor 'x' ...",
                reason,
            )

        agent.StartWorkers = refuse
        estimator = FakeEstimator(
            [ranked(1, common.WEIGHT_QUANT_NONE), ranked(2, common.WEIGHT_QUANT_INT8)]
        )
        controller = await controller_on(store, agent, 4, estimator=estimator)
        intent = common.Intent(kind=common.INTENT_KIND_MIN_COST)
        with pytest.raises(IServeError, match="no longer the model registered") as err:
            await controller.deploy(deploy_pb.DeployRequest(model_id="m", intent=intent))
        assert len(agent.started) == (1 if reason else 2)
        assert ("no configuration of m could be launched" in str(err.value)) == (not reason)
        assert await nothing_left(store)

    run(scenario)


def test_the_reconciler_takes_out_a_replica_whose_workers_are_gone(run):
    """After a deployer restart: replica 0's worker is not running (it died under its
    agent, which keeps its record), replica 1's is; a reservation of a replica no record
    names is an orphan."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2, policy=NO_RESTARTS)
        dep = (await controller.deploy(deploy_request(2))).deployment
        deployment_id = dep.deployment_id
        await store.reserve(f"{deployment_id}.r5", {("node0", "cpu1"): MIB})

        async def list_workers(request, timeout):
            return agent_pb.ListWorkersResponse(
                workers=[
                    agent_pb.WorkerInfo(
                        deployment_id=deployment_id,  # replica 0's group
                        rank=0,
                        state=agent_pb.WORKER_STATE_FAILED,
                    ),
                    agent_pb.WorkerInfo(
                        deployment_id=f"{deployment_id}.r1",
                        rank=0,
                        state=agent_pb.WORKER_STATE_READY,
                    ),
                ]
            )

        agent.ListWorkers = list_workers
        actions = await Reconciler(controller, store, agent).reconcile_on_start()
        assert actions == [
            f"failed {deployment_id}: after a deployer restart, rank(s) [0] are not running",
            f"released orphaned reservation {deployment_id}.r5",
        ]
        now = await store.get_deployment(deployment_id)
        assert now.state == READY
        assert [r.state for r in now.replicas] == [FAILED, READY]
        assert await store.reservation_owners() == {f"{deployment_id}.r1"}

        # Then the agent reports replica 1's worker dead: the last replica fails it all.
        await Reconciler(controller, store, agent).handle(
            {"kind": "worker_died", "deployment_id": f"{deployment_id}.r1", "rank": 0}
        )
        assert (await store.get_deployment(deployment_id)).state == FAILED
        assert await store.reservation_owners() == set()

    run(scenario)


def test_a_worker_reported_unreachable_after_a_clean_stop_is_restored_not_failed(run):
    """`iserve down` then `iserve up` with clients still sending: the scheduler reports
    the old worker unreachable before any agent has answered the deployer. Its replica
    was stopped on purpose: it is restored at once, spending no restart budget (five such
    restarts of the stack left busy deployments FAILED)."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        dep = (await controller.deploy(deploy_request(1))).deployment
        await store.mark_deployer_stopped(1)

        async def starting(request, timeout):  # the agent is not up yet
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")

        agent.ListWorkers = starting
        reconciler = Reconciler(controller, store, agent)
        assert await reconciler.reconcile_on_start() == []
        await reconciler.handle(
            {
                "kind": "worker_unreachable",
                "deployment_id": dep.deployment_id,
                "worker_address": dep.worker_address,
            }
        )
        record = await controller.healer.record_of(dep.deployment_id)
        assert (record.in_a_row, record.total) == (0, 0)
        events, last = [], "0-0"
        while batch := await store.read_events(last, block_ms=10):
            events += [e for _, e in batch]
            last = batch[-1][0]
        [restarting] = [e for e in events if e["kind"] == "replica_restarting"]
        assert restarting["reason"] == "the stack was stopped on purpose (worker unreachable)"
        # Only once: a later loss of the restored replica is a failure again.
        assert dep.deployment_id not in reconciler._stopped_on_purpose
        await controller.healer.close()

    run(scenario)


def test_a_repeat_of_a_deploy_still_starting_answers_what_the_first_does(run):
    async def scenario(store):
        agent = FakeAgent()
        agent.gate = asyncio.Event()
        controller = await controller_on(store, agent, 2, 2)
        request = deploy_request(1, request_id="same-id")
        first = asyncio.create_task(controller.deploy(request))
        while not agent.started:  # the first has placed, reserved and is launching
            await asyncio.sleep(0.01)
        repeat = asyncio.create_task(controller.deploy(request))
        await asyncio.sleep(0.3)
        assert not repeat.done()  # it returned STARTING with no worker before
        agent.gate.set()
        one, two = (await first).deployment, (await repeat).deployment
        assert one.deployment_id == two.deployment_id and two.state == READY
        assert two.worker_address == one.worker_address != ""
        assert agent.started == [one.deployment_id]  # launched once
        await controller.remove(one.deployment_id)
        assert await nothing_left(store)

    run(scenario)


@pytest.mark.parametrize("how", ["explicit", "intent"])
def test_a_remove_while_the_workers_start_aborts_the_deploy_and_its_repeat(run, how):
    # The workers come up only after the Remove has stopped the group (the agent had not
    # started them yet). Deploy answered READY for the removed deployment; an intent
    # must not go on to its next configuration under the removed id either.
    def ranked(rank: int) -> estimator_pb.RankedConfig:
        config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1, batch_size=1)
        estimate = estimator_pb.ConfigEstimate(config=config, memory_total_bytes=GIB // 10)
        return estimator_pb.RankedConfig(rank=rank, estimate=estimate, meets_intent=True)

    async def scenario(store):
        agent = FakeAgent()
        agent.gate = asyncio.Event()
        controller = await controller_on(
            store, agent, 2, 2, estimator=FakeEstimator([ranked(1), ranked(2)])
        )
        if how == "explicit":
            request = deploy_request(1, request_id="removed-id")
        else:
            intent = common.Intent(kind=common.INTENT_KIND_MIN_COST)
            request = deploy_pb.DeployRequest(model_id="m", intent=intent, request_id="removed-id")
        # What each Deploy's claim of the request id answered: the earlier binding.
        claims: list[str | None] = []
        claim = store.claim_deploy_request

        async def recorded_claim(
            request_id: str, deployment_id: str, asked: str, *, owner: str = ""
        ) -> str | None:
            earlier = await claim(request_id, deployment_id, asked, owner=owner)
            claims.append(earlier)
            return earlier

        store.claim_deploy_request = recorded_claim
        first = asyncio.create_task(controller.deploy(request))
        while not agent.started:
            await asyncio.sleep(0.01)
        repeat = asyncio.create_task(controller.deploy(request))
        # The repeat found the first's claim: it now waits for the first to end.
        async with asyncio.timeout(10):
            while len(claims) < 2:
                await asyncio.sleep(0.01)
        [deployment] = await store.list_deployments()
        assert claims == [None, deployment.deployment_id]
        await controller.remove(deployment.deployment_id)
        agent.gate.set()
        for call in (first, repeat):
            with pytest.raises(DeploymentRemoved) as removed:
                await call
            assert removed.value.code == grpc.StatusCode.ABORTED
            assert str(removed.value) == (
                f"deployment {deployment.deployment_id} was removed while it was starting"
            )
        assert agent.started == [deployment.deployment_id]  # nothing else launched
        assert agent.stopped == [deployment.deployment_id] * 2  # by Remove, then by Deploy
        assert await nothing_left(store)
        assert await store.deploy_request("removed-id") is None
        # The request id is free again: a Deploy with it now deploys afresh.
        again = (await controller.deploy(request)).deployment
        assert again.deployment_id != deployment.deployment_id and again.state == READY
        await controller.remove(again.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_repeat_while_its_deployment_is_being_removed_deploys_afresh_once_it_is_gone(run):
    """A Deploy repeated (same request id) while Remove drained its deployment was
    answered "deployed" with the REMOVING record, gone a moment later (a probe). A
    removed deployment's request id deploys afresh: the repeat waits for the removal."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        request = deploy_request(1, request_id="drained-id")
        first = (await controller.deploy(request)).deployment
        agent.stop_gate = asyncio.Event()
        removing = asyncio.create_task(controller.remove(first.deployment_id))
        async with asyncio.timeout(10):
            while not agent.stopped:
                await asyncio.sleep(0.01)
        assert (await store.get_deployment(first.deployment_id)).state == REMOVING
        repeat = asyncio.create_task(controller.deploy(request))
        await asyncio.sleep(0.3)
        assert not repeat.done()  # not answered with the deployment being removed
        agent.stop_gate.set()
        await removing
        again = (await repeat).deployment
        assert again.deployment_id != first.deployment_id and again.state == READY
        await controller.remove(again.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_remove_while_another_drains_the_deployment_answers_ok(run):
    """A second Remove during the first's drain waited for it, then said NOT_FOUND of the
    deployment the listing still showed REMOVING (a probe)."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        dep = (await controller.deploy(deploy_request(1))).deployment
        restored = await store.get_deployment(dep.deployment_id)
        restored.state_reason = "serves again after a stop of the stack"
        await store.put_deployment(restored)
        agent.stop_gate = asyncio.Event()
        first = asyncio.create_task(controller.remove(dep.deployment_id))
        async with asyncio.timeout(10):
            while not agent.stopped:
                await asyncio.sleep(0.01)
        # Requests refused meanwhile are told it is being removed, not its last reason
        # (a tester saw "is REMOVING: serves again after a stop of the stack").
        draining = await store.get_deployment(dep.deployment_id)
        assert draining.state == deploy_pb.DEPLOYMENT_STATE_REMOVING
        assert draining.state_reason == REMOVING_REASON
        second = asyncio.create_task(controller.remove(dep.deployment_id))
        await asyncio.sleep(0.1)
        agent.stop_gate.set()
        await asyncio.gather(first, second)
        assert await nothing_left(store)
        with pytest.raises(NotFound):  # once gone, an unknown deployment
            await controller.remove(dep.deployment_id)

    run(scenario)


def test_a_request_id_bound_before_the_upgrade_is_checked_against_its_deployment(run):
    """A request id an older iserve bound kept no record of what its Deploy asked: reused
    with other limits or another configuration after an upgrade, it was answered with
    the old deployment as if made (a probe). It is checked against what the deployment
    has; a true repeat still gets it."""
    from services.state import keys

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        first = (
            await controller.deploy(deploy_request(1, request_id="old", max_output_tokens=32))
        ).deployment
        await store.redis.delete(keys.deploy_request_asked("old"))  # as an older one left it
        repeat = deploy_request(1, request_id="old", max_output_tokens=32)
        assert (await controller.deploy(repeat)).deployment.deployment_id == first.deployment_id
        assert (
            await controller.deploy(deploy_request(1, request_id="old"))
        ).deployment.deployment_id == first.deployment_id  # what it left unset was chosen
        for other, named in [
            ({"max_output_tokens": 8}, "max_output_tokens"),
            ({"batch_size": 4}, "batch_size"),
            ({"config": common.DeploymentConfig(tensor_parallel=2)}, "config"),
        ]:
            with pytest.raises(FailedPrecondition, match=f"which asked for other {named};"):
                await controller.deploy(deploy_request(1, request_id="old", **other))
        assert agent.started == [first.deployment_id]
        await controller.remove(first.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_a_request_id_reused_for_another_request_is_refused_not_answered(run):
    """A repeat of a Deploy answers what the first made; a Deploy of another model with
    the same request id is no repeat: refused, the first deployment untouched (before,
    it was handed back as if it were this model's)."""

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        other = model()
        other.model_id = "m2"
        await store.create_model(other)
        first = (await controller.deploy(deploy_request(1, request_id="rid-1"))).deployment
        again = (await controller.deploy(deploy_request(1, request_id="rid-1"))).deployment
        assert again.deployment_id == first.deployment_id
        with pytest.raises(FailedPrecondition) as refused:
            await controller.deploy(deploy_request(1, request_id="rid-1", model_id="m2"))
        assert str(refused.value) == (
            f"request_id 'rid-1' was used by a Deploy of model m (deployment "
            f"{first.deployment_id}); give this Deploy of m2 a request id of its own"
        )
        # The same model asked for something else is no repeat either (it was handed the
        # first deployment, two replicas asked for and one got); a longer wait is.
        with pytest.raises(FailedPrecondition) as refused:
            await controller.deploy(deploy_request(2, request_id="rid-1", max_output_tokens=64))
        assert str(refused.value) == (
            f"request_id 'rid-1' was used by another Deploy (deployment "
            f"{first.deployment_id}), which asked for other max_output_tokens, replicas; "
            "a repeat must ask the same: give this Deploy a request id of its own"
        )
        waits = deploy_request(1, request_id="rid-1", ready_timeout_ms=90_000)
        assert (await controller.deploy(waits)).deployment.deployment_id == first.deployment_id
        assert agent.started == [first.deployment_id]
        assert [d.deployment_id for d in await store.list_deployments()] == [first.deployment_id]
        await controller.remove(first.deployment_id)
        assert await nothing_left(store)

    run(scenario)


def test_request_ids_are_each_owners_own(run):
    """A request id was one key for all tenants: bob, deploying first with a common key,
    made alice's Deploy with it fail (PERMISSION_DENIED, naming bob's deployment) until
    bob removed his. Each subject now has its own keys; a repeat is still a repeat."""
    from services.auth import access, policy
    from services.auth.tokens import Principal

    async def as_(who: str, call):
        token = access.set_caller(Principal(f"t-{who}", who, policy.APP_DEVELOPER))
        try:
            return await call()
        finally:
            access.reset_caller(token)

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)

        def deploy():
            return controller.deploy(deploy_request(1, request_id="deploy-1"))

        bobs = (await as_("bob", deploy)).deployment
        alices = (await as_("alice", deploy)).deployment
        assert (bobs.owner, alices.owner) == ("bob", "alice")
        assert bobs.deployment_id != alices.deployment_id
        assert (await as_("alice", deploy)).deployment.deployment_id == alices.deployment_id
        assert (await as_("bob", deploy)).deployment.deployment_id == bobs.deployment_id
        await controller.remove(bobs.deployment_id)
        assert (await as_("alice", deploy)).deployment.deployment_id == alices.deployment_id
        await controller.remove(alices.deployment_id)
        assert await nothing_left(store)
        assert [k async for k in store.redis.scan_iter("iserve:deploy-request*")] == []

    run(scenario)


def test_a_request_id_kept_from_before_it_was_scoped_finds_its_deployment(run):
    """An upgrade: a Deploy made by an iserve that kept request ids unscoped, retried
    with the same id after it, made a second deployment (a probe). The deployer's start
    moves such ids to their owner's keys."""
    from services.auth import access, policy
    from services.auth.tokens import Principal
    from services.state import keys

    async def scenario(store):
        agent = FakeAgent()
        controller = await controller_on(store, agent, 2, 2)
        token = access.set_caller(Principal("t-alice", "alice", policy.APP_DEVELOPER))
        try:
            first = (await controller.deploy(deploy_request(1, request_id="rid-1"))).deployment
            # As the older iserve left it: the unscoped keys.
            for key in (keys.deploy_request, keys.deploy_request_asked):
                await store.redis.rename(key("rid-1", "alice"), key("rid-1"))
            actions = await Reconciler(controller, store, agent).reconcile_on_start()
            assert f"moved the Deploy request id of {first.deployment_id} to its owner's keys" in (
                actions
            )
            again = (await controller.deploy(deploy_request(1, request_id="rid-1"))).deployment
            assert again.deployment_id == first.deployment_id
            assert await store.redis.get(keys.deploy_request("rid-1")) is None
            # A second start moves nothing.
            assert not any(
                a.startswith("moved")
                for a in await Reconciler(controller, store, agent).reconcile_on_start()
            )
            await controller.remove(first.deployment_id)
        finally:
            access.reset_caller(token)
        assert await nothing_left(store)
        assert [k async for k in store.redis.scan_iter("iserve:deploy-request*")] == []

    run(scenario)


def test_a_deploy_before_the_start_up_pass_is_told_why_it_has_not_run(run, monkeypatch):
    """A Redis user without EVALSHA failed the deployer's start-up pass each second: every
    Deploy waited for ever, the reason in the deployer's log alone."""
    from deploy_svc import controller as controller_module

    monkeypatch.setattr(controller_module, "RECONCILE_WAIT_S", 0.2)

    async def scenario(store):
        controller = await controller_on(store, FakeAgent(), 2)
        controller.reconciled.clear()
        controller.reconcile_error = "StateStoreRefused: … lacks a permission iserve needs"
        with pytest.raises(Unavailable, match="not yet matched its records .*lacks a permission"):
            await controller.deploy(deploy_request(1))
        assert await store.list_deployments() == []
        assert await store.reservation_owners() == set()

    run(scenario)
