"""ModelService: protobuf in, registry decisions, Redis records, protobuf out."""

from __future__ import annotations

from fingerprint_svc.registry import build_model, check_model_id
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.api import model_service_pb2_grpc
from services.errors import AlreadyExists, FailedPrecondition, NotFound, Unimplemented
from services.settings import Settings
from services.state.store import StateStore

LIVE_DEPLOYMENT_STATES = {
    deploy_pb.DEPLOYMENT_STATE_STARTING,
    deploy_pb.DEPLOYMENT_STATE_READY,
    deploy_pb.DEPLOYMENT_STATE_REMOVING,
}


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, settings: Settings, store: StateStore):
        self.settings = settings
        self.store = store

    async def _model(self, model_id: str) -> model_pb.Model:
        check_model_id(model_id)
        model = await self.store.get_model(model_id)
        if model is None:
            raise NotFound(f"model {model_id!r} is not registered")
        return model

    async def RegisterModel(self, request, context):
        model = build_model(request, self.settings.models_root)
        if not await self.store.create_model(model):
            raise AlreadyExists(f"model {request.model_id!r} is already registered")
        return model_pb.RegisterModelResponse(request_id=request.request_id, model=model)

    async def GetModel(self, request, context):
        model = await self._model(request.model_id)
        return model_pb.GetModelResponse(request_id=request.request_id, model=model)

    async def ListModels(self, request, context):
        models = await self.store.list_models()
        return model_pb.ListModelsResponse(request_id=request.request_id, models=models)

    async def DeleteModel(self, request, context):
        await self._model(request.model_id)
        live = [
            d.deployment_id
            for d in await self.store.list_deployments(request.model_id)
            if d.state in LIVE_DEPLOYMENT_STATES
        ]
        if live:
            raise FailedPrecondition(
                f"model {request.model_id!r} is deployed ({', '.join(live)}); remove those first"
            )
        await self.store.delete_model(request.model_id)
        return model_pb.DeleteModelResponse(request_id=request.request_id)

    async def WatchModel(self, request, context):
        model = await self._model(request.model_id)
        yield model_pb.WatchModelResponse(
            request_id=request.request_id,
            state=model.state,
            message=model.state_reason or model_pb.ModelState.Name(model.state),
        )

    async def GetProfile(self, request, context):
        await self._model(request.model_id)
        raise Unimplemented("GetProfile arrives with fingerprint profiling (issue 4)")

    async def ImportProfiles(self, request, context):
        raise Unimplemented("ImportProfiles arrives with estimation (issue 4)")
