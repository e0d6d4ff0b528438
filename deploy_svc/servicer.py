"""DeploymentService: protobuf in, controller decisions, protobuf out."""

from __future__ import annotations

from deploy_svc.controller import DeploymentController, unknown_deployment
from services.api import deployment_service_pb2 as deploy_pb
from services.api import deployment_service_pb2_grpc
from services.auth import access
from services.drain import InFlight
from services.ids import check_model_id

# After the drain, how long the Deploys cut off get to roll back before the server stops.
CUT_OFF_ROLLBACK_S = 10.0


class DeploymentServicer(deployment_service_pb2_grpc.DeploymentServiceServicer):
    """Every call is counted (``in_flight``): on a stop, :meth:`drain` refuses new ones
    with "deployment service is draining", waits for those in flight, then cuts off the
    Deploys still running, which roll back and answer with their deployment id."""

    def __init__(self, controller: DeploymentController):
        self.controller = controller
        self.in_flight = InFlight("deployment service")

    async def drain(self, timeout_s: float) -> bool:
        if await self.in_flight.drain(timeout_s):
            return True
        await self.controller.cut_off_deploys(CUT_OFF_ROLLBACK_S)
        return await self.in_flight.drain(1.0)

    async def Deploy(self, request, context):
        self.in_flight.admit(context)
        return await self.controller.deploy(request)

    async def PlanDeployment(self, request, context):
        self.in_flight.admit(context)
        decision = await self.controller.plan(request)
        return deploy_pb.PlanDeploymentResponse(request_id=request.request_id, decision=decision)

    async def GetDeployment(self, request, context):
        self.in_flight.admit(context)
        deployment = await self.controller.get(request.deployment_id)
        # Read as ListDeployments reads: a developer sees every deployment (the cluster's
        # state names them all), a user the ones its token grants.
        access.check_see(
            deployment.deployment_id,
            deployment.owner,
            unknown=unknown_deployment(request.deployment_id),
        )
        return deploy_pb.GetDeploymentResponse(request_id=request.request_id, deployment=deployment)

    async def ListDeployments(self, request, context):
        self.in_flight.admit(context)
        if request.model_id:
            # Refused as every other call refuses it (it listed nothing, as if valid).
            check_model_id(request.model_id)
        if request.usable_only:
            access.check_may_generate()
        deployments = await self.controller.store.list_deployments(request.model_id)
        deployments = access.visible(deployments)
        if request.usable_only:
            deployments = access.usable(deployments)
        return deploy_pb.ListDeploymentsResponse(
            request_id=request.request_id, deployments=deployments
        )

    async def RemoveDeployment(self, request, context):
        self.in_flight.admit(context)
        await self.controller.remove(request.deployment_id)
        return deploy_pb.RemoveDeploymentResponse(request_id=request.request_id)

    async def GetClusterState(self, request, context):
        self.in_flight.admit(context)
        state = await self.controller.cluster_state()
        state.request_id = request.request_id
        return state
