"""Deployment lifecycle: reserve, launch through the agents, record, remove, fail.

The decision (hardware type, configuration, devices, layers) is ``planning``'s and the
worker groups on the agents are ``workers``'; this module only reads state, asks the
estimator for a ranking, reserves, launches, records, and guarantees that a failed
Deploy leaves nothing behind: no reservation, no record, no worker. A deployment fails
through one path (:meth:`mark_failed`). A Remove that comes while Deploy still starts the
workers aborts that Deploy (ABORTED, :class:`DeploymentRemoved`): it never answers READY
for a deployment that was removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from deploy_svc import healing, planning
from deploy_svc.agents import AgentClients
from deploy_svc.explicit import ExplicitPlan, checkpoint_for, resolve_limits
from deploy_svc.healer import Healer
from deploy_svc.objectives import fallback_objectives, latency_model, resolve_objectives
from deploy_svc.workers import WorkerGroups
from services import replicas
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import estimator_service_pb2 as estimator_pb
from services.api import estimator_service_pb2_grpc
from services.api import model_service_pb2 as model_pb
from services.auth import access
from services.errors import (
    CHECKPOINT_UNUSABLE,
    FailedPrecondition,
    InvalidArgument,
    IServeError,
    NotFound,
    RemoteError,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from services.grpc_server import channel
from services.ids import (
    check_deployment_id,
    is_valid_id,
    new_deployment_id,
    replica_group_id,
    split_group_id,
)
from services.intents import check_intent, with_default
from services.settings import Settings
from services.state.capacity import largest_device_bytes
from services.state.records import decode, encode
from services.state.store import ReservationError, StateStore

log = logging.getLogger("iserve.deploy")

# How long a Deploy waits for the deployer's start-up pass before it is told why not.
RECONCILE_WAIT_S = 60.0
RESERVE_ATTEMPTS = 3
RANK_TIMEOUT_S = 60.0
# A REMOVING deployment's state_reason.
REMOVING_REASON = "being removed: its streams finish, then its workers stop"


def _now_ms() -> int:
    return int(time.time() * 1000)


def unknown_deployment(deployment_id: str) -> NotFound:
    """What a request naming a deployment that does not exist gets (and an application
    user, one its token does not grant)."""
    return NotFound(f"deployment {deployment_id!r} does not exist")


class DeploymentRemoved(IServeError):
    """A Remove of the deployment came while its Deploy was starting it. Not a failed
    launch: nothing failed, and no other configuration is tried."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, deployment_id: str):
        super().__init__(f"deployment {deployment_id} was removed while it was starting")


class ModelBeingDeleted(FailedPrecondition):
    """A DeleteModel of the model came while Deploy recorded its deployment: not a
    failed launch, and no other configuration is tried."""

    def __init__(self, model_id: str):
        super().__init__(f"model {model_id!r} is being deleted")


@dataclass(eq=False)
class _DeployCall:
    """A Deploy running in this process, as a repeat of its request id waits for it."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    removed: bool = False
    # The task that runs it, and whether the service's stop cut it off (cut_off_deploys).
    task: asyncio.Future | None = None
    cut_off: bool = False


def _need(placement: common.Placement) -> dict[tuple[str, str], int]:
    """Bytes to reserve on each (node id, device id) of a placement."""
    return {
        (ref.node_id, ref.device_id): stage.reserved_bytes[i]
        for stage in placement.stages
        for i, ref in enumerate(stage.devices)
    }


def _from_the_model(model: model_pb.Model, config: common.DeploymentConfig) -> bool:
    """Whether ``config`` is served from the model's own checkpoint (not a variant's)."""
    return checkpoint_for(model, config) == model.checkpoint_path


class DeploymentController:
    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        agents: AgentClients,
        restart_policy: healing.RestartPolicy | None = None,
    ):
        self.settings = settings
        self.store = store
        self.agents = agents
        self.workers = WorkerGroups(settings, store, agents)
        self._locks: dict[str, asyncio.Lock] = {}
        # The Deploy calls running here, by the deployment id each would create.
        self._calls: dict[str, _DeployCall] = {}
        self._estimator: estimator_service_pb2_grpc.EstimatorServiceStub | None = None
        self._estimator_channel: grpc.aio.Channel | None = None
        # Set once the reconciler's start-up pass has run; Deploy waits for it so that
        # start-up cleanup never mistakes a reservation of a Deploy in flight for an orphan.
        self.reconciled = asyncio.Event()
        # Why the start-up pass failed last, while it retries ("" before, or once done).
        self.reconcile_error = ""
        self.healer = Healer(
            store,
            self.workers,
            self.lock,
            self.mark_failed,
            self.reconciled,
            restart_policy or healing.RestartPolicy(),
        )

    @property
    def estimator(self) -> estimator_service_pb2_grpc.EstimatorServiceStub:
        if self._estimator is None:
            self._estimator_channel = channel(self.settings.address("estimator"))
            self._estimator = estimator_service_pb2_grpc.EstimatorServiceStub(
                self._estimator_channel
            )
        return self._estimator

    async def close(self) -> None:
        await self.healer.close()
        if self._estimator_channel is not None:
            await self._estimator_channel.close()
        await self.agents.close()

    def lock(self, deployment_id: str) -> asyncio.Lock:
        return self._locks.setdefault(deployment_id, asyncio.Lock())

    def deploying(self, deployment_id: str) -> bool:
        """Whether a Deploy running in this process creates ``deployment_id``."""
        return deployment_id in self._calls

    async def forget_request_of(self, deployment: deploy_pb.Deployment) -> None:
        """Free the request id of the Deploy that made ``deployment``, which failed
        before it was ready (cut off): a retry with that id deploys afresh, as after a
        Deploy that failed while it ran, instead of being answered "deployed" with the
        FAILED record (a probe)."""
        request_id, owner = deployment.request_id, deployment.owner
        if request_id and (
            await self.store.deploy_request(request_id, owner=owner) == deployment.deployment_id
        ):
            await self.store.forget_deploy_request(request_id, owner=owner)

    # ---- queries --------------------------------------------------------------------
    async def get(self, deployment_id: str) -> deploy_pb.Deployment:
        check_deployment_id(deployment_id)
        deployment = await self.store.get_deployment(deployment_id)
        if deployment is None:
            raise unknown_deployment(deployment_id)
        return deployment

    async def cluster_state(self) -> deploy_pb.GetClusterStateResponse:
        # A node whose agent does not answer is shown as not alive: nothing goes there.
        nodes = await self._listed_nodes()
        # The records, and the ids on the devices, of the deployments the caller may read
        # (a model developer sees the devices and what is free, not deployments).
        deployments = access.readable(await self.store.list_deployments())
        # A replica is on the devices it holds memory on: one waiting for a node (its
        # reservation released) was listed on the devices it had left.
        holding = await self.store.reservation_owners()
        where: dict[tuple[str, str], list[str]] = {}
        for dep in deployments:
            if dep.state == deploy_pb.DEPLOYMENT_STATE_FAILED:
                continue
            for replica in replicas.replicas_of(dep):
                if replica.state == deploy_pb.DEPLOYMENT_STATE_FAILED:
                    continue
                if replica_group_id(dep.deployment_id, replica.index) not in holding:
                    continue
                for stage in replica.placement.stages:
                    for ref in stage.devices:
                        where.setdefault((ref.node_id, ref.device_id), []).append(dep.deployment_id)
        for node in nodes:
            for dev in node.devices:
                dev.deployment_ids.extend(where.get((dev.ref.node_id, dev.ref.device_id), []))
                if not node.alive:
                    # Its last figures stay, but nothing can be placed there.
                    dev.free_bytes = 0
        return deploy_pb.GetClusterStateResponse(nodes=nodes, deployments=deployments)

    # ---- planning -------------------------------------------------------------------
    async def _model(self, model_id: str, *, launch: bool) -> model_pb.Model:
        model = await self.store.require_model(model_id)
        # A launch needs the checkpoint, not a profile: a model can be deployed with an
        # explicit configuration while it is being profiled, or after profiling failed.
        # A plan needs neither (imported measurements are enough to rank and place).
        if launch and not model.checkpoint_path:
            raise FailedPrecondition(
                f"model {model_id!r} has no checkpoint (its measurements were imported); "
                "to deploy it, register its checkpoint under another model id "
                "(`iserve register ID DIR`): the imported id keeps its measurements"
            )
        return model

    async def _nodes(self, request) -> list[common.NodeState]:
        """The live nodes, or the request's simulated devices grouped into nodes."""
        simulated = list(getattr(request, "devices", []))
        if simulated:
            return planning.simulated_nodes(simulated)
        return await self._listed_nodes()

    async def _listed_nodes(self) -> list[common.NodeState]:
        """The nodes in Redis, those whose agent did not answer the deployer's last call
        taken as not alive (AgentClients.usable): nothing is placed on them."""
        return self.workers.reach.usable(await self.store.list_nodes())

    async def _options(
        self, model: model_pb.Model, request, limits: ExplicitPlan, nodes
    ) -> tuple[list[planning.Option], str | None, str]:
        """The configurations to try in rank order, the hardware type they are for (None:
        any device) and the ranking's note. Explicit: the one configuration. Intent: the
        estimator's ranking on the hardware type with the most live devices among those
        the model is profiled on."""
        if request.HasField("config"):
            note = "explicit configuration"
            if request.HasField("intent") and request.intent.ByteSize():
                # Taken beside a configuration, and checked, but not used: say so (a
                # tester's 1 ms latency SLO went unmentioned).
                kind = common.IntentKind.Name(with_default(request.intent).kind)
                note += f" (the intent, {kind.removeprefix('INTENT_KIND_')}, is not used)"
            return [planning.Option(rank=1, config=limits.config)], None, note
        intent = with_default(request.intent)
        check_intent(intent)
        order = planning.hardware_order(nodes)
        if not order:
            raise ResourceExhausted("no live devices to deploy on")
        refusals = []
        for hardware_type, device_count in order:
            try:
                reply = await self.estimator.RankConfigs(
                    estimator_pb.RankConfigsRequest(
                        request_id=request.request_id,
                        model_id=model.model_id,
                        hardware_type=hardware_type,
                        workload=estimator_pb.Workload(
                            input_tokens=limits.max_input_tokens,
                            output_tokens=limits.max_output_tokens,
                            batch_size=limits.config.batch_size,
                        ),
                        device_count=device_count,
                        device_memory_bytes=largest_device_bytes(nodes, hardware_type),
                        intent=intent,
                    ),
                    timeout=RANK_TIMEOUT_S,
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or "not profiled" not in (
                    exc.details() or ""
                ):
                    raise from_rpc_error(
                        exc, f"ranking configurations of {model.model_id}"
                    ) from exc
                refusals.append(exc.details())
                continue
            options = planning.options_from_ranking(reply.ranked)
            devices = f"{device_count} device{'s' if device_count != 1 else ''}"
            note = "; ".join(
                p for p in (f"ranked for {hardware_type} ({devices})", reply.note) if p
            )
            return options, hardware_type, note
        raise FailedPrecondition(
            f"cannot rank {model.model_id} for an intent: " + "; ".join(refusals)
        )

    async def _prepare(self, request, *, launch: bool) -> planning.Prepared:
        """Everything a Deploy/PlanDeployment decision needs but the devices' current
        state: the model, limits, policy and the ranked options (one ranking per call)."""
        replicas.check_count(request.replicas)
        model = await self._model(request.model_id, launch=launch)
        try:
            policy = planning.policy_name(request.placement_policy)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        nodes = await self._nodes(request)
        cuda = planning.on_cuda(nodes)
        limits = resolve_limits(model, request, cuda=cuda)
        explicit = request.HasField("config")
        if explicit and request.HasField("intent"):
            # Unused beside a configuration, but not taken malformed (a fuzzing tester's
            # NaN latency target passed in silence).
            check_intent(with_default(request.intent))
        objectives = resolve_objectives(
            request.objectives, None if explicit else with_default(request.intent)
        )
        options, hardware_type, note = await self._options(model, request, limits, nodes)
        auto_batch = not request.batch_size and not (explicit and request.config.batch_size)
        budget = None
        if not explicit and request.intent.kind == common.INTENT_KIND_COST_SLO:
            budget = (request.intent.cost_formula, request.intent.cost_budget)
        return planning.Prepared(
            model, limits, policy, cuda, options, hardware_type, note, nodes, objectives,
            auto_batch, budget, None if explicit else with_default(request.intent).kind,
        )  # fmt: skip

    async def _decide(
        self, request, prepared: planning.Prepared, nodes, excluded=None
    ) -> tuple[deploy_pb.DeploymentDecision, common.LatencyModel, common.ServiceObjectives]:
        """planning's decision on ``nodes`` at the batch it chooses (when the request
        left it 0), the scheduler's starting latency model for it, and the objectives
        its record keeps (:func:`fallback_objectives`)."""
        decision = planning.decide_on(prepared, nodes, excluded)
        hardware_type = planning.hardware_of(decision, nodes)
        unprofiled = planning.unprofiled_dtype(prepared, decision.config)
        batch1 = batch2 = None
        if unprofiled:
            decision = planning.with_note(decision, unprofiled)
        else:
            batch1 = await self._estimate_of(
                request, prepared, nodes, hardware_type, decision.config, 1
            )
        if batch1 is not None:
            batch2 = await self._estimate_of(
                request, prepared, nodes, hardware_type, decision.config, 2
            )
        if prepared.auto_batch:
            decision = planning.size_batch(
                prepared, decision, nodes, batch1, batch2, prepared.objectives
            )
        if batch1 is not None:
            decision = planning.with_estimate(prepared, decision, nodes, batch1, batch2)
        meets = planning.meets_intent(prepared, decision)
        objectives, said = fallback_objectives(
            prepared.objectives,
            None if request.HasField("config") else request.intent,
            request.objectives.default_deadline_ms,
            meets,
            decision.estimate.latency_ms,
        )
        if said:
            decision = planning.with_note(decision, said)
        latency = latency_model(batch1, batch2, prepared.limits.max_input_tokens)
        return decision, latency, objectives

    async def _estimate_of(
        self,
        request,
        prepared: planning.Prepared,
        nodes: list[common.NodeState],
        hardware_type: str,
        config: common.DeploymentConfig,
        batch: int,
    ) -> estimator_pb.ConfigEstimate | None:
        """The estimator's figures for ``config`` at ``batch`` on ``hardware_type``; None
        when the model is not profiled there. Asked for ``nodes``' devices of that type,
        as the ranking was: by default the estimator scores the live cluster's, and a
        plan on more simulated devices chose configurations beyond them. A model never
        profiled (or still profiling), with no measurements imported, is not asked about:
        each explicit deploy of one left a FAILED_PRECONDITION in the estimator's log and
        call counts (a probe)."""
        unprofiled = (model_pb.MODEL_STATE_REGISTERED, model_pb.MODEL_STATE_PROFILING)
        if prepared.model.state in unprofiled and not await self.store.get_profile_sources(
            prepared.model.model_id
        ):
            return None
        try:
            reply = await self.estimator.EstimateConfigs(
                estimator_pb.EstimateConfigsRequest(
                    request_id=request.request_id,
                    model_id=prepared.model.model_id,
                    hardware_type=hardware_type,
                    workload=estimator_pb.Workload(
                        input_tokens=prepared.limits.max_input_tokens,
                        output_tokens=prepared.limits.max_output_tokens,
                        batch_size=batch,
                    ),
                    device_count=dict(planning.hardware_order(nodes)).get(hardware_type, 0),
                    device_memory_bytes=largest_device_bytes(nodes, hardware_type),
                ),
                timeout=RANK_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            # Not profiled on this hardware type (FAILED_PRECONDITION), or the estimator
            # is down: an explicit configuration still deploys, at batch 1 when the
            # batch was left to the deployer.
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                log.warning("no estimate of %s: %s", prepared.model.model_id, exc.details())
            return None
        return planning.matching_estimate(reply.estimates, config)

    async def plan(self, request) -> deploy_pb.DeploymentDecision:
        """The decision for a PlanDeployment request against the live cluster (or
        ``request.devices`` when given)."""
        prepared = await self._prepare(request, launch=False)
        count = replicas.count_of(request.replicas)
        excluded: dict[int, str] = {}
        while True:
            decision, _, _ = await self._decide(request, prepared, prepared.nodes, excluded)
            try:
                more = planning.replica_placements(prepared, decision, prepared.nodes, count)
            except ResourceExhausted as exc:
                if request.HasField("config"):
                    raise
                # As a deploy does: the next configuration whose replicas all fit.
                excluded[decision.winner_rank] = str(exc)
                continue
            decision.replica_placements.extend(more)
            return decision

    async def _until_reconciled(self) -> None:
        """Wait for the start-up pass, at most RECONCILE_WAIT_S: UNAVAILABLE with why it
        has not run after that (a Redis user without a permission it needs made Deploy
        wait for ever, the reason in the deployer's log alone)."""
        if self.reconciled.is_set():
            return
        try:
            await asyncio.wait_for(self.reconciled.wait(), RECONCILE_WAIT_S)
        except TimeoutError:
            why = f": {self.reconcile_error}" if self.reconcile_error else ""
            raise Unavailable(
                "the deployer has not yet matched its records with Redis and the agents "
                f"since it started{why}"
            ) from None

    # ---- deploy ---------------------------------------------------------------------
    async def deploy(self, request: deploy_pb.DeployRequest) -> deploy_pb.DeployResponse:
        await self._until_reconciled()
        deployment_id = new_deployment_id(request.model_id)
        # A model may be registered under a deployment id's shape: never share it. (An
        # invalid model id is refused below, and names no key to look at.)
        while is_valid_id(request.model_id) and not await self.store.deployment_id_is_free(
            deployment_id
        ):
            deployment_id = new_deployment_id(request.model_id)
        # Known before the request id is claimed, so that a repeat that finds the claim
        # finds this call too (_outcome_of).
        call = self._calls[deployment_id] = _DeployCall()
        # A task of its own, so that a stop of the service can cut it off (it rolls back)
        # and this call still answers, with the deployment id (cut_off_deploys).
        call.task = asyncio.ensure_future(self._deploy_once(request, deployment_id))
        try:
            return await call.task
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if call.cut_off and not (this is not None and this.cancelling()):
                raise Unavailable(
                    f"the deployment service stopped before deployment {deployment_id} of "
                    f"{request.model_id} was ready: it was rolled back (its workers "
                    "stopped, its memory released); deploy again once the service is back"
                ) from None
            raise
        except DeploymentRemoved:
            call.removed = True
            raise
        finally:
            call.ended.set()
            del self._calls[deployment_id]

    async def cut_off_deploys(self, wait_s: float) -> None:
        """Cut off every Deploy running here (the service stops and its drain is over):
        each rolls back and answers UNAVAILABLE naming its deployment; waits up to
        ``wait_s`` seconds for the rollbacks."""
        tasks = []
        for call in list(self._calls.values()):
            if call.task is not None and not call.task.done():
                call.cut_off = True
                call.task.cancel()
                tasks.append(call.task)
        if tasks:
            log.warning("cutting off %d Deploy call(s) still running at the stop", len(tasks))
            await asyncio.wait(tasks, timeout=wait_s)

    async def _deploy_once(self, request, deployment_id: str) -> deploy_pb.DeployResponse:
        """Deploy as ``deployment_id``, or answer what an earlier Deploy with the same
        request id answers."""
        if request.request_id:
            asked = _asked(request)
            earlier = await self.store.claim_deploy_request(
                request.request_id, deployment_id, asked, owner=access.owner()
            )
            if earlier is not None:
                existing = await self._outcome_of(request.request_id, earlier)
                if existing is not None:
                    if existing.model_id != request.model_id:
                        # A repeat is the same request; this one names another model.
                        raise FailedPrecondition(
                            f"request_id {request.request_id!r} was used by a Deploy of "
                            f"model {existing.model_id} (deployment "
                            f"{existing.deployment_id}); give this Deploy of "
                            f"{request.model_id} a request id of its own"
                        )
                    before = await self.store.deploy_request_asked(
                        request.request_id, owner=access.owner()
                    )
                    differ = (
                        _fields_that_differ(before, asked)
                        if before
                        # Bound by an iserve that kept no record of what was asked (the
                        # record of an upgrade's earlier version): the deployment it made.
                        else _unlike_deployment(request, existing)
                    )
                    if differ:
                        # The same key for another request returned the first one's
                        # deployment, as if this one had been carried out.
                        raise FailedPrecondition(
                            f"request_id {request.request_id!r} was used by another Deploy "
                            f"(deployment {existing.deployment_id}), which asked for other "
                            f"{', '.join(differ)}; a repeat must ask the same: give this "
                            "Deploy a request id of its own"
                        )
                    return deploy_pb.DeployResponse(
                        request_id=request.request_id, deployment=existing
                    )
                # The earlier call failed (its claim was forgotten): this one deploys.
                return await self.deploy(request)
        try:
            return await self._deploy(request, deployment_id)
        except BaseException:
            # Only this call's claim: a rollback or a Remove may have freed it already,
            # and another Deploy may have claimed it since.
            if request.request_id and (
                await self.store.deploy_request(request.request_id, owner=access.owner())
                == deployment_id
            ):
                await self.store.forget_deploy_request(request.request_id, owner=access.owner())
            raise

    async def _outcome_of(self, request_id: str, deployment_id: str) -> deploy_pb.Deployment | None:
        """The deployment an earlier Deploy with ``request_id`` made, once it is no longer
        starting (a repeat while the first still places and launches answers what the
        first does, not a STARTING record without a worker); None when that call failed
        and forgot the request id; DeploymentRemoved when a Remove aborted it. After
        ``ready_timeout_s`` and a margin, the record as it stands."""
        deadline = time.monotonic() + 2 * self.settings.ready_timeout_s + 30.0
        first = self._calls.get(deployment_id)
        if first is not None:
            # The first call runs here: its end tells a removal from a failure, which
            # leave Redis alike (no record, no request id).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(first.ended.wait(), deadline - time.monotonic())
            if first.removed:
                raise DeploymentRemoved(deployment_id)
        while True:
            existing = await self.store.get_deployment(deployment_id)
            late = time.monotonic() > deadline
            if existing is not None and existing.state == deploy_pb.DEPLOYMENT_STATE_REMOVING:
                # Being removed: once it is gone its request id deploys afresh, so the
                # repeat waits for that (it was answered "deployed" with the REMOVING
                # record, gone a moment later: a probe).
                if late:
                    raise Unavailable(
                        f"deployment {deployment_id}, which the Deploy with request_id "
                        f"{request_id!r} made, is being removed; try again once it is gone"
                    )
            elif existing is not None:
                # A restart is not the first call's launch: the deployment served before.
                first_launch = existing.state == deploy_pb.DEPLOYMENT_STATE_STARTING
                if late or not first_launch or replicas.is_restarting(existing):
                    return existing
            elif await self.store.deploy_request(request_id, owner=access.owner()) != deployment_id:
                return None
            elif late:
                raise Unavailable(
                    f"the Deploy with request_id {request_id!r} is still being planned; try again"
                )
            await asyncio.sleep(0.1)

    async def _deploy(self, request, deployment_id: str) -> deploy_pb.DeployResponse:
        """Plan, reserve (every replica), launch; on a lost reservation race plan again,
        when the replicas do not fit or the launch fails roll back and try the next
        configuration (intents only)."""
        prepared = await self._prepare(request, launch=True)
        model, nodes = prepared.model, prepared.nodes
        count = replicas.count_of(request.replicas)
        excluded: dict[int, str] = {}
        races = 0
        last_failure: IServeError | None = None
        while True:
            try:
                decision, latency, objectives = await self._decide(
                    request, prepared, nodes, excluded
                )
            except ResourceExhausted as exc:
                if last_failure is None:
                    raise
                # Every configuration left failed to launch: say so with the launch's
                # own status, and list what was tried.
                # Each was placed, and its launch failed: not "cannot be placed".
                tried = exc.tried if isinstance(exc, planning.NothingPlaced) else ""
                message = (
                    f"no configuration of {request.model_id} could be launched ({tried})"
                    if tried
                    else f"no configuration could be launched; {exc}"
                )
                if isinstance(last_failure, RemoteError):
                    raise RemoteError(last_failure.code, message) from last_failure
                raise type(last_failure)(message) from last_failure
            try:
                await self.store.reserve(deployment_id, _need(decision.placement))
            except ReservationError as exc:
                # Another deployer took the room between planning and reserving.
                races += 1
                if races >= RESERVE_ATTEMPTS:
                    excluded[decision.winner_rank] = f"could not reserve memory: {exc}"
                    races = 0
                nodes = await self._listed_nodes()
                continue
            try:
                more = await self._reserve_replicas(prepared, decision, deployment_id, count)
            except BaseException as exc:
                await self.store.release(deployment_id)
                if not isinstance(exc, ResourceExhausted) or request.HasField("config"):
                    raise
                excluded[decision.winner_rank] = str(exc)
                last_failure = exc
                races = 0
                nodes = await self._listed_nodes()
                continue
            decision.replica_placements.extend(more)
            try:
                return await self._launch(
                    request, deployment_id, prepared, decision, latency, objectives
                )
            except (DeploymentRemoved, ModelBeingDeleted):
                raise
            except IServeError as exc:
                if request.HasField("config"):
                    raise
                if getattr(exc, "reason", "") == CHECKPOINT_UNUSABLE and _from_the_model(
                    model, decision.config
                ):
                    # Every configuration is served from the model's own checkpoint
                    # (a variant's own one aside): each would be refused the same way.
                    raise
                log.warning(
                    "configuration #%d of %s failed to launch, trying the next: %s",
                    decision.winner_rank,
                    model.model_id,
                    exc,
                )
                excluded[decision.winner_rank] = f"launch failed: {exc}"
                last_failure = exc
                races = 0
                nodes = await self._listed_nodes()

    async def _launch(
        self,
        request,
        deployment_id: str,
        prepared: planning.Prepared,
        decision: deploy_pb.DeploymentDecision,
        latency: common.LatencyModel,
        objectives: common.ServiceObjectives,
    ) -> deploy_pb.DeployResponse:
        """Record, start and wait for the workers of every replica of a reserved decision
        (replica 0 on ``decision.placement``, the others on ``decision.replica_placements``);
        on any failure, or a Remove meanwhile (DeploymentRemoved), stop what started,
        release every replica's memory and delete the record."""
        model, limits = prepared.model, prepared.limits
        deployment = deploy_pb.Deployment(
            deployment_id=deployment_id,
            model_id=model.model_id,
            config=decision.config,
            placement=decision.placement,
            state=deploy_pb.DEPLOYMENT_STATE_STARTING,
            max_input_tokens=limits.max_input_tokens,
            max_output_tokens=limits.max_output_tokens,
            created_at_unix_ms=_now_ms(),
            request_id=request.request_id,
            estimate=decision.estimate,
            owner=access.owner(),
            objectives=objectives,
            latency_model=latency,
        )
        for index, where in enumerate([decision.placement, *decision.replica_placements]):
            deployment.replicas.add(
                index=index, placement=where, state=deploy_pb.DEPLOYMENT_STATE_STARTING
            )
        try:
            # DeleteModel (the model service) marks the model, then looks for its
            # deployments; this records one only while the model is unmarked, in one
            # step: of a Deploy and a Delete racing, only the later is refused (recorded,
            # then looked at, both were refused when they came within milliseconds).
            # A model deleted and registered again since is another model.
            current = await self.store.put_deployment_of_model(deployment)
            if current is None or current.created_at_unix_ms != model.created_at_unix_ms:
                raise ModelBeingDeleted(model.model_id)
            # Every replica starts at once; all are waited for (none is left starting
            # behind a teardown), and the first failure fails the Deploy.
            started = await asyncio.gather(
                *(
                    self.workers.start(
                        model, deployment, replica, limits.max_seq_len, request.ready_timeout_ms
                    )
                    for replica in deployment.replicas
                ),
                return_exceptions=True,
            )
        except BaseException:
            await self._roll_back(deployment)
            raise
        failure = next((o for o in started if isinstance(o, BaseException)), None)
        # Remove holds the lock from start to end: one that came while the workers started
        # has ended (it stopped them, or they started after it and are stopped here), and
        # one that comes later finds the record READY, or none.
        async with self.lock(deployment_id):
            current = await self.store.get_deployment(deployment_id)
            removed = current is None or current.state == deploy_pb.DEPLOYMENT_STATE_REMOVING
            if removed or failure is not None:
                await self._roll_back(deployment)
            else:
                for replica, address in zip(deployment.replicas, started, strict=True):
                    replica.worker_address = address
                    replica.state = deploy_pb.DEPLOYMENT_STATE_READY
                deployment.worker_address = deployment.replicas[0].worker_address
                deployment.state = deploy_pb.DEPLOYMENT_STATE_READY
                await self.store.put_deployment(deployment)
                await self.store.publish_event("deployment_ready", deployment_id=deployment_id)
        if removed or failure is not None:
            self._locks.pop(deployment_id, None)
            if removed:
                # The workers' failure, if any, is the Remove stopping them.
                raise DeploymentRemoved(deployment_id) from failure
            raise failure
        log.info(
            "deployment %s ready at %s (%s, rank %d, %d replica(s))",
            deployment_id,
            ", ".join(r.worker_address for r in deployment.replicas),
            planning.describe(decision.config),
            decision.winner_rank,
            len(deployment.replicas),
        )
        return deploy_pb.DeployResponse(
            request_id=request.request_id, deployment=deployment, decision=decision
        )

    async def _roll_back(self, deployment: deploy_pb.Deployment) -> None:
        """Stop every replica's workers, release their memory, delete the record."""
        await self.workers.teardown(deployment)
        await self.store.delete_deployment(deployment)

    async def _reserve_replicas(
        self,
        prepared: planning.Prepared,
        decision: deploy_pb.DeploymentDecision,
        deployment_id: str,
        count: int,
    ) -> list[common.Placement]:
        """Place replicas 1 … ``count`` - 1 beside the reserved replica 0 on the devices as
        they are now and reserve each under its group id: all of them or none (a lost
        race places them again). ResourceExhausted naming the replica that does not
        fit."""
        if count <= 1:
            return []
        for attempt in range(1, RESERVE_ATTEMPTS + 1):
            nodes = await self._listed_nodes()
            placements = planning.replica_placements(prepared, decision, nodes, count)
            reserved: list[str] = []
            try:
                for index, where in enumerate(placements, start=1):
                    group = replica_group_id(deployment_id, index)
                    await self.store.reserve(group, _need(where))
                    reserved.append(group)
            except BaseException as exc:
                for group in reserved:
                    await self.store.release(group)
                if not isinstance(exc, ReservationError):
                    raise
                if attempt == RESERVE_ATTEMPTS:
                    raise ResourceExhausted(
                        f"replica {len(reserved) + 1} of {count}: could not reserve memory: {exc}"
                    ) from None
                continue
            return placements
        raise AssertionError("unreachable")

    async def mark_failed(self, deployment: deploy_pb.Deployment, reason: str) -> None:
        """Record ``deployment`` FAILED with ``reason``, stop what is left of it, release
        its memory and say so: the one way a deployment fails."""
        deployment.state = deploy_pb.DEPLOYMENT_STATE_FAILED
        deployment.state_reason = reason
        replicas.fail_all(deployment, reason)
        await self.store.put_deployment(deployment)
        await self.workers.teardown(deployment)
        await self.store.publish_event(
            "deployment_failed", deployment_id=deployment.deployment_id, reason=reason
        )
        log.warning("deployment %s failed: %s", deployment.deployment_id, reason)

    # ---- remove and fail ------------------------------------------------------------
    async def remove(self, deployment_id: str) -> None:
        """Drain and stop the deployment's workers, release its devices, drop its record.
        A Remove that comes while another drains it waits for that one and answers OK
        (it said NOT_FOUND of a deployment still listed REMOVING: a probe)."""
        check_deployment_id(deployment_id)
        before = await self.store.get_deployment(deployment_id)
        async with self.lock(deployment_id):
            try:
                deployment = await self.get(deployment_id)
            except NotFound:
                if before is None or before.state != deploy_pb.DEPLOYMENT_STATE_REMOVING:
                    raise
                access.check_owner(f"deployment {deployment_id}", before.owner)
                return  # removed by the Remove under way when this one came
            access.check_owner(f"deployment {deployment_id}", deployment.owner)
            deployment.state = deploy_pb.DEPLOYMENT_STATE_REMOVING
            # What it is doing now: the reason of its last state ("serves again after a
            # stop of the stack") was told to requests refused while it drained.
            deployment.state_reason = REMOVING_REASON
            await self.store.put_deployment(deployment)
            await self.workers.teardown(deployment)
            await self.store.delete_deployment(deployment)
            await self.store.publish_event("deployment_removed", deployment_id=deployment_id)
        self._locks.pop(deployment_id, None)

    async def fail(
        self,
        group_id: str,
        reason: str,
        *,
        planned: bool = False,
        lost_rank: bool = False,
        unresponsive: bool = False,
    ) -> bool:
        """A worker of ``group_id`` (a deployment id, or a replica's group id) is gone:
        take that replica out (stop its workers, release its memory) and start it again
        after a backoff (``deploy_svc.healer``); once the restart budget is spent it
        stays out, and the deployment is FAILED when no other replica serves. A
        ``planned`` loss (the stack was stopped on purpose) starts it again at once and
        spends no budget; an ``unresponsive`` worker's group is stopped without waiting
        out a drain. Returns False when the deployment is gone, not READY or the
        replica already out."""
        deployment_id, index = split_group_id(group_id)
        async with self.lock(deployment_id):
            deployment = await self.store.get_deployment(deployment_id)
            if deployment is None or index not in {r.index for r in replicas.serving(deployment)}:
                return False
            await self.healer.replica_failed(
                deployment,
                index,
                reason,
                planned=planned,
                lost_rank=lost_rank,
                unresponsive=unresponsive,
            )
            return True


def _asked(request: deploy_pb.DeployRequest) -> str:
    """What a Deploy asks for, as a repeat of it must ask too: the request without its
    request id and its wait (a retry may wait longer for the same deployment)."""
    asked = deploy_pb.DeployRequest()
    asked.CopyFrom(request)
    asked.request_id = ""
    asked.ready_timeout_ms = 0
    return encode(asked)


def _unlike_deployment(
    request: deploy_pb.DeployRequest, existing: deploy_pb.Deployment
) -> list[str]:
    """What ``request`` asks that ``existing`` (the deployment its request id is bound to)
    does not have, of what the deployment records: its token limits, batch size and
    explicit configuration, each where the request sets it (what it leaves unset was
    chosen for it)."""
    differ = [
        name
        for name in ("max_input_tokens", "max_output_tokens")
        if getattr(request, name) and getattr(request, name) != getattr(existing, name)
    ]
    if request.batch_size and request.batch_size != existing.config.batch_size:
        differ.append("batch_size")
    if request.HasField("config"):
        asked, made = request.config, existing.config
        parallel = ("tensor_parallel", "pipeline_parallel")
        chosen = ("variant_name", "weight_quant", "kv_quant", "pruning", "dtype")
        if any((getattr(asked, f) or 1) != (getattr(made, f) or 1) for f in parallel) or any(
            getattr(asked, f) and getattr(asked, f) != getattr(made, f) for f in chosen
        ):
            differ.append("config")
    return differ


def _fields_that_differ(before: str, now: str) -> list[str]:
    """The DeployRequest fields in which two :func:`_asked` records differ."""
    try:
        first = decode(deploy_pb.DeployRequest, before)
    except json_format.Error:
        return []  # unreadable: not a reason to refuse a repeat
    second = decode(deploy_pb.DeployRequest, now)
    return [
        field.name
        for field in deploy_pb.DeployRequest.DESCRIPTOR.fields
        if getattr(first, field.name) != getattr(second, field.name)
    ]
