"""DeploymentService: protobuf in, controller decisions, protobuf out."""

from __future__ import annotations

from deploy_svc.controller import DeploymentController, unknown_deployment
from services.api import deployment_service_pb2 as deploy_pb
from services.api import deployment_service_pb2_grpc
from services.auth import access


class DeploymentServicer(deployment_service_pb2_grpc.DeploymentServiceServicer):
    def __init__(self, controller: DeploymentController):
        self.controller = controller

    async def Deploy(self, request, context):
        return await self.controller.deploy(request)

    async def PlanDeployment(self, request, context):
        decision = await self.controller.plan(request)
        return deploy_pb.PlanDeploymentResponse(request_id=request.request_id, decision=decision)

    async def GetDeployment(self, request, context):
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
        deployments = await self.controller.store.list_deployments(request.model_id)
        deployments = access.visible(deployments)
        if request.usable_only:
            deployments = access.usable(deployments)
        return deploy_pb.ListDeploymentsResponse(
            request_id=request.request_id, deployments=deployments
        )

    async def RemoveDeployment(self, request, context):
        await self.controller.remove(request.deployment_id)
        return deploy_pb.RemoveDeploymentResponse(request_id=request.request_id)

    async def GetClusterState(self, request, context):
        state = await self.controller.cluster_state()
        state.request_id = request.request_id
        return state
