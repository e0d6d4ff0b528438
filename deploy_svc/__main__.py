"""``python -m deploy_svc``: serve DeploymentService (and TokenService, which issues the
bearer tokens) on ``ISERVE_DEPLOY_ADDR``."""

import logging
import time

from deploy_svc.agents import AgentClients
from deploy_svc.controller import DeploymentController
from deploy_svc.healing import RestartPolicy
from deploy_svc.reconciler import Reconciler
from deploy_svc.servicer import DeploymentServicer
from deploy_svc.tokens import TokenServicer
from services.api import deployment_service_pb2_grpc
from services.grpc_server import ServiceBinding
from services.service_main import ServiceParts, serve_service


def build(settings, store) -> ServiceParts:
    agents = AgentClients()
    controller = DeploymentController(settings, store, agents, RestartPolicy.of(settings))
    reconciler = Reconciler(controller, store, agents)
    servicer = DeploymentServicer(controller)

    async def stop() -> None:
        await controller.close()
        # The workers the agents stop next (iserve down) are then restored at the next
        # start without counting against any restart budget (deploy_svc.reconciler).
        try:
            await store.mark_deployer_stopped(int(time.time() * 1000))
        except Exception as exc:  # noqa: BLE001 - Redis gone first: the restore counts
            logging.getLogger("iserve.deploy").warning("could not record a clean stop: %s", exc)

    return ServiceParts(
        bindings=[
            ServiceBinding(
                servicer,
                deployment_service_pb2_grpc.add_DeploymentServiceServicer_to_server,
                "iserve.v1.DeploymentService",
            ),
            TokenServicer(store, settings).binding(),
        ],
        background=[reconciler.run],
        on_stop=stop,
        drain=servicer.drain,
    )


if __name__ == "__main__":
    serve_service("deploy", build)
