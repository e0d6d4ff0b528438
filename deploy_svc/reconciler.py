"""Keeps deployment records true to the workers: a worker that died, a worker the
scheduler cannot reach, or a node whose agent stopped heartbeating fails its
deployment, which releases the deployment's memory."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy_svc.controller import DeploymentController
from services.api import deployment_service_pb2 as deploy_pb
from services.grpc_server import channel
from services.state.store import StateStore

log = logging.getLogger("iserve.deploy.reconciler")
HEALTH_TIMEOUT_S = 1.0


async def worker_answers(address: str) -> bool:
    async with channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Reconciler:
    def __init__(self, controller: DeploymentController, store: StateStore):
        self.controller = controller
        self.store = store

    async def handle(self, event: dict) -> None:
        deployment_id = event.get("deployment_id", "")
        kind = event.get("kind")
        if not deployment_id:
            return
        if kind == "worker_died":
            await self.controller.fail(
                deployment_id,
                f"worker rank {event.get('rank')} exited ({event.get('exit_code')}): {event.get('reason', '')}".strip(),
            )
        elif kind == "worker_unreachable":
            deployment = await self.store.get_deployment(deployment_id)
            if deployment and not await worker_answers(deployment.worker_address):
                await self.controller.fail(
                    deployment_id, f"worker unreachable: {event.get('reason', '')}".strip()
                )

    async def check_nodes(self) -> None:
        alive = {n.node_id for n in await self.store.list_nodes() if n.alive}
        for deployment in await self.store.list_deployments():
            if deployment.state != deploy_pb.DEPLOYMENT_STATE_READY:
                continue
            dead = {
                ref.node_id
                for stage in deployment.placement.stages
                for ref in stage.devices
                if ref.node_id not in alive
            }
            if dead:
                await self.controller.fail(
                    deployment.deployment_id,
                    f"node agent(s) {', '.join(sorted(dead))} stopped heartbeating",
                )

    async def run(self) -> None:
        last = await self.store.last_event_id()
        while True:
            try:
                await self.controller.reconcile()
                break
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - retry until Redis and the agents answer
                log.exception("start-up reconciliation failed; retrying")
                await asyncio.sleep(1.0)
        while True:
            try:
                for event_id, event in await self.store.read_events(last, block_ms=1000):
                    last = event_id
                    await self.handle(event)
                await self.check_nodes()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive a bad event or a Redis blip
                log.exception("reconciliation step failed")
                await asyncio.sleep(1.0)
