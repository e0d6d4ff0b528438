"""Deployment lifecycle: reserve, launch through the agents, record, remove, fail.

The decisions (what config, which devices, which layers) come from the plain modules
``explicit``, ``memory`` and ``placement``; this module does the I/O around them and
guarantees that a failed Deploy leaves nothing behind: no reservation, no record, no
worker.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc

from deploy_svc import placement
from deploy_svc.agents import AgentClients
from deploy_svc.explicit import ExplicitPlan, resolve_explicit
from deploy_svc.memory import rank_memory
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unimplemented,
    from_rpc_error,
)
from services.settings import Settings
from services.state.store import ReservationError, StateStore

log = logging.getLogger("iserve.deploy")
MIB = 1 << 20
RESERVE_ATTEMPTS = 3
STOP_TIMEOUT_S = 15.0


def _now_ms() -> int:
    return int(time.time() * 1000)


class DeploymentController:
    def __init__(self, settings: Settings, store: StateStore, agents: AgentClients):
        self.settings = settings
        self.store = store
        self.agents = agents
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, deployment_id: str) -> asyncio.Lock:
        return self._locks.setdefault(deployment_id, asyncio.Lock())

    # ---- queries --------------------------------------------------------------------
    async def get(self, deployment_id: str) -> deploy_pb.Deployment:
        if not deployment_id or ":" in deployment_id:
            raise InvalidArgument(f"invalid deployment_id {deployment_id!r}")
        deployment = await self.store.get_deployment(deployment_id)
        if deployment is None:
            raise NotFound(f"deployment {deployment_id!r} does not exist")
        return deployment

    async def cluster_state(self) -> deploy_pb.GetClusterStateResponse:
        nodes = await self.store.list_nodes()
        deployments = await self.store.list_deployments()
        where: dict[tuple[str, str], list[str]] = {}
        for dep in deployments:
            if dep.state == deploy_pb.DEPLOYMENT_STATE_FAILED:
                continue
            for stage in dep.placement.stages:
                for ref in stage.devices:
                    where.setdefault((ref.node_id, ref.device_id), []).append(dep.deployment_id)
        for node in nodes:
            for dev in node.devices:
                dev.deployment_ids.extend(where.get((dev.ref.node_id, dev.ref.device_id), []))
        return deploy_pb.GetClusterStateResponse(nodes=nodes, deployments=deployments)

    # ---- planning -------------------------------------------------------------------
    async def _model(self, model_id: str) -> model_pb.Model:
        if not model_id:
            raise InvalidArgument("model_id is empty")
        model = await self.store.get_model(model_id)
        if model is None:
            raise NotFound(f"model {model_id!r} is not registered")
        # An explicit configuration needs the checkpoint, not a profile: a model can be
        # deployed while it is being profiled, or after profiling failed.
        if not model.checkpoint_path:
            raise FailedPrecondition(
                f"model {model_id!r} has no checkpoint (its measurements were imported); "
                "register a checkpoint to deploy it"
            )
        return model

    async def plan(
        self, request
    ) -> tuple[model_pb.Model, deploy_pb.DeploymentDecision, ExplicitPlan]:
        """The decision for a Deploy/PlanDeployment request against the live cluster (or
        ``request.devices`` when given); returns the model, the decision and the limits."""
        model = await self._model(request.model_id)
        if not request.HasField("config"):
            raise Unimplemented(
                "intent-based deployment arrives with issue 5; pass an explicit config (tp, pp)"
            )
        plan = resolve_explicit(
            model,
            request.config,
            batch_size=request.batch_size,
            max_input_tokens=request.max_input_tokens,
            max_output_tokens=request.max_output_tokens,
        )
        config = plan.config
        layer_map = placement.even_layer_map(model.shape.num_layers, config.pipeline_parallel)
        need = max(
            rank_memory(model.shape, config, plan.max_seq_len, count).total_bytes
            for _, count in layer_map
        )
        simulated = list(getattr(request, "devices", []))
        if simulated:
            nodes = [common.NodeState(node_id="simulated", alive=True, devices=simulated)]
        else:
            nodes = await self.store.list_nodes()
        devices = placement.candidates(nodes)
        count = config.tensor_parallel * config.pipeline_parallel
        chosen = placement.choose_devices(devices, count, need)
        if chosen is None:
            biggest = placement.largest_free(devices)
            where = (
                f"largest free: {biggest.free_bytes / MIB:.0f} MiB on {biggest.node_id}/{biggest.device_id}"
                if biggest
                else "no live devices"
            )
            raise ResourceExhausted(
                f"no {count} device(s) with {need / MIB:.0f} MiB free for {model.model_id} "
                f"(tp={config.tensor_parallel} pp={config.pipeline_parallel} batch={config.batch_size} "
                f"max_seq_len={plan.max_seq_len}; {where})"
            )
        stages = []
        for stage, (first, layer_count) in enumerate(layer_map):
            group = chosen[stage * config.tensor_parallel : (stage + 1) * config.tensor_parallel]
            stages.append(
                common.StagePlacement(
                    stage=stage,
                    first_layer=first,
                    layer_count=layer_count,
                    devices=[
                        common.DeviceRef(node_id=d.node_id, device_id=d.device_id) for d in group
                    ],
                    reserved_bytes=[need] * len(group),
                )
            )
        decision = deploy_pb.DeploymentDecision(
            config=config,
            placement=common.Placement(stages=stages),
            winner_rank=1,
            note="explicit configuration",
        )
        decision.estimate.memory_per_device_bytes = need
        decision.estimate.memory_total_bytes = need * count
        decision.estimate.config.CopyFrom(config)
        return model, decision, plan

    # ---- deploy ---------------------------------------------------------------------
    async def deploy(self, request: deploy_pb.DeployRequest) -> deploy_pb.DeployResponse:
        deployment_id = f"{request.model_id}-{secrets.token_hex(4)}"
        if request.request_id:
            if ":" in request.request_id:
                raise InvalidArgument("request_id must not contain ':'")
            earlier = await self.store.claim_deploy_request(request.request_id, deployment_id)
            if earlier is not None:
                existing = await self.store.get_deployment(earlier)
                if existing is not None:
                    return deploy_pb.DeployResponse(
                        request_id=request.request_id, deployment=existing
                    )
        try:
            return await self._deploy(request, deployment_id)
        except BaseException:
            if request.request_id:
                await self.store.forget_deploy_request(request.request_id)
            raise

    async def _deploy(self, request, deployment_id: str) -> deploy_pb.DeployResponse:
        for attempt in range(RESERVE_ATTEMPTS):
            model, decision, limits = await self.plan(request)
            need = {
                (ref.node_id, ref.device_id): stage.reserved_bytes[i]
                for stage in decision.placement.stages
                for i, ref in enumerate(stage.devices)
            }
            try:
                await self.store.reserve(deployment_id, need)
                break
            except ReservationError as exc:
                # Another deployer took the room between planning and reserving; re-plan.
                if attempt == RESERVE_ATTEMPTS - 1:
                    raise ResourceExhausted(f"cannot reserve memory: {exc}") from exc
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
        )
        try:
            await self.store.put_deployment(deployment)
            workers = await self._start_workers(
                model, deployment, limits.max_seq_len, request.ready_timeout_ms
            )
        except BaseException:
            await self._teardown(deployment)
            await self.store.delete_deployment(deployment)
            raise
        rank0 = next(w for w in workers if w.rank == 0)
        deployment.worker_address = rank0.address
        deployment.state = deploy_pb.DEPLOYMENT_STATE_READY
        await self.store.put_deployment(deployment)
        await self.store.publish_event("deployment_ready", deployment_id=deployment_id)
        log.info("deployment %s ready at %s", deployment_id, deployment.worker_address)
        return deploy_pb.DeployResponse(
            request_id=request.request_id, deployment=deployment, decision=decision
        )

    async def _agent_address(self, node_id: str) -> str:
        for node in await self.store.list_nodes():
            if node.node_id == node_id:
                if not node.alive:
                    raise FailedPrecondition(f"node {node_id} is not alive")
                return node.agent_address
        raise FailedPrecondition(f"node {node_id} is unknown")

    async def _start_workers(self, model, deployment, max_seq_len: int, ready_timeout_ms: int):
        timeout_ms = ready_timeout_ms or int(self.settings.ready_timeout_s * 1000)
        config = deployment.config
        by_node: dict[str, list[agent_pb.WorkerSpec]] = {}
        for stage in deployment.placement.stages:
            for tensor_rank, ref in enumerate(stage.devices):
                by_node.setdefault(ref.node_id, []).append(
                    agent_pb.WorkerSpec(
                        rank=stage.stage * config.tensor_parallel + tensor_rank,
                        device_id=ref.device_id,
                        stage=stage.stage,
                        tensor_rank=tensor_rank,
                        first_layer=stage.first_layer,
                        layer_count=stage.layer_count,
                    )
                )
        calls = []
        for node_id, specs in by_node.items():
            stub = self.agents.stub(await self._agent_address(node_id))
            calls.append(
                stub.StartWorkers(
                    agent_pb.StartWorkersRequest(
                        request_id=deployment.request_id,
                        deployment_id=deployment.deployment_id,
                        checkpoint_path=model.checkpoint_path,
                        config=config,
                        workers=specs,
                        max_seq_len=max_seq_len,
                        engine=agent_pb.ENGINE_KIND_PYTORCH,
                        ready_timeout_ms=timeout_ms,
                    ),
                    timeout=timeout_ms / 1000 + 10,
                )
            )
        try:
            replies = await asyncio.gather(*calls)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, f"starting workers of {deployment.deployment_id}") from exc
        return [w for reply in replies for w in reply.workers]

    async def _teardown(self, deployment: deploy_pb.Deployment) -> None:
        """Stop the deployment's workers on every node (best effort) and release its memory."""
        nodes = {ref.node_id for stage in deployment.placement.stages for ref in stage.devices}
        for node_id in nodes:
            try:
                stub = self.agents.stub(await self._agent_address(node_id))
                await stub.StopWorkers(
                    agent_pb.StopWorkersRequest(deployment_id=deployment.deployment_id),
                    timeout=STOP_TIMEOUT_S,
                )
            except (grpc.RpcError, FailedPrecondition) as exc:
                log.warning(
                    "could not stop workers of %s on %s: %s", deployment.deployment_id, node_id, exc
                )
        await self.store.release(deployment.deployment_id)

    # ---- remove and fail ------------------------------------------------------------
    async def remove(self, deployment_id: str) -> None:
        async with self._lock(deployment_id):
            deployment = await self.get(deployment_id)
            deployment.state = deploy_pb.DEPLOYMENT_STATE_REMOVING
            await self.store.put_deployment(deployment)
            await self._teardown(deployment)
            await self.store.delete_deployment(deployment)
            await self.store.publish_event("deployment_removed", deployment_id=deployment_id)
        self._locks.pop(deployment_id, None)

    async def fail(self, deployment_id: str, reason: str) -> bool:
        """Mark a READY deployment FAILED, stop what is left of it and release its memory.
        Returns False when the deployment is gone or not READY (nothing to do)."""
        async with self._lock(deployment_id):
            deployment = await self.store.get_deployment(deployment_id)
            if deployment is None or deployment.state != deploy_pb.DEPLOYMENT_STATE_READY:
                return False
            deployment.state = deploy_pb.DEPLOYMENT_STATE_FAILED
            deployment.state_reason = reason
            await self.store.put_deployment(deployment)
            await self._teardown(deployment)
            await self.store.publish_event(
                "deployment_failed", deployment_id=deployment_id, reason=reason
            )
            log.warning("deployment %s failed: %s", deployment_id, reason)
            return True
