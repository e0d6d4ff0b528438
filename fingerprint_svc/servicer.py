"""ModelService: protobuf in, registry decisions, Redis records, protobuf out."""

from __future__ import annotations

import asyncio
import logging

from fingerprint_svc.importing import import_profiles
from fingerprint_svc.profiler import Profiler
from fingerprint_svc.registry import build_model, check_retry, state_name
from services.api import model_service_pb2 as model_pb
from services.api import model_service_pb2_grpc
from services.auth import access
from services.errors import AlreadyExists, FailedPrecondition, NotFound
from services.settings import Settings
from services.state.store import StateStore

log = logging.getLogger(__name__)

# How long a DeleteModel's mark on its model lasts at most (a crash leaves it behind):
# longer than a delete takes between marking and deleting.
DELETE_MARK_TTL_S = 120.0
# How often WatchModel looks at the model's record and progress.
WATCH_POLL_S = 0.2


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, settings: Settings, store: StateStore, profiler: Profiler | None = None):
        self.settings = settings
        self.store = store
        self.profiler = profiler or Profiler(settings, store)
        # Serialises what reads a model record, checks it and writes it: retries of FAILED
        # registrations, imports (which check the owner of each model they change and
        # write its record, profile and sources in steps) and deletes. Within this
        # process only: the manifests run one model service.
        self._register_lock = asyncio.Lock()

    async def _model(self, model_id: str) -> model_pb.Model:
        return await self.store.require_model(model_id)

    async def RegisterModel(self, request, context):
        model = build_model(request, self.settings.models_root)
        model.owner = access.owner()
        async with self._register_lock:
            await self.store.refuse_a_deployments_id(model.model_id)
            if not await self.store.create_model(model):
                await self._register_again(model, skip_profiling=request.skip_profiling)
            if not request.skip_profiling:
                await self.profiler.start(model)
        return model_pb.RegisterModelResponse(request_id=request.request_id, model=model)

    async def _register_again(self, model: model_pb.Model, *, skip_profiling: bool) -> None:
        """Overwrite a FAILED record of the same checkpoint, or an unprofiled one that is
        now to be profiled, with ``model``; AlreadyExists for anything else."""
        existing = await self.store.get_model(model.model_id)
        if existing is None:  # deleted since create_model looked
            if not await self.store.create_model(model):
                raise AlreadyExists(f"model {model.model_id!r} is already registered")
            return
        access.check_owner(f"model {model.model_id!r}", existing.owner)
        check_retry(
            existing,
            model,
            profiling=self.profiler.running(model.model_id),
            skip_profiling=skip_profiling,
        )
        model.created_at_unix_ms = existing.created_at_unix_ms
        await self.store.put_model(model)

    async def GetModel(self, request, context):
        model = await self._model(request.model_id)
        return model_pb.GetModelResponse(request_id=request.request_id, model=model)

    async def ListModels(self, request, context):
        models = await self.store.list_models()
        return model_pb.ListModelsResponse(request_id=request.request_id, models=models)

    async def DeleteModel(self, request, context):
        async with self._register_lock:
            model = await self._model(request.model_id)
            access.check_owner(f"model {request.model_id!r}", model.owner)
            try:
                await self._mark_deleting(request.model_id)
                if self.profiler.running(request.model_id):
                    await self.profiler.cancel(request.model_id)
                    # Cancelling may outlast the mark: mark and look again.
                    await self._mark_deleting(request.model_id)
                await self.store.delete_model(request.model_id)
            finally:
                await self.store.clear_model_deleting(request.model_id)
        await self._release_fingerprints(model)
        return model_pb.DeleteModelResponse(request_id=request.request_id)

    async def _release_fingerprints(self, model: model_pb.Model) -> None:
        """Remove the fingerprints no registered model profiles on any more."""
        freed = await self.profiler.forget(model, await self.store.list_models())
        if freed:
            log.info(
                "model %s deleted: %.1f MiB of fingerprints removed", model.model_id, freed / 2**20
            )

    async def _mark_deleting(self, model_id: str) -> None:
        """Mark the model as being deleted, then refuse (FailedPrecondition) when it has
        deployments in any state. The deployment service, another process, records a
        deployment only while the model is unmarked, in one step
        (``StateStore.put_deployment_of_model``): whichever comes first wins, and only
        the other is refused."""
        await self.store.mark_model_deleting(model_id, DELETE_MARK_TTL_S)
        deployed = [d.deployment_id for d in await self.store.list_deployments(model_id)]
        if deployed:
            raise FailedPrecondition(
                f"model {model_id!r} has deployments ({', '.join(deployed)}); remove those first"
            )

    async def WatchModel(self, request, context):
        model = await self._model(request.model_id)
        last = None
        while True:
            event = await self._watch_event(model, request.request_id)
            if event != last:
                yield event
                last = event
            if model.state != model_pb.MODEL_STATE_PROFILING:
                return
            await asyncio.sleep(WATCH_POLL_S)
            model = await self.store.get_model(request.model_id)
            if model is None:
                raise NotFound(f"model {request.model_id!r} was deleted while being watched")

    async def _watch_event(self, model: model_pb.Model, request_id: str):
        """Where ``model``'s profiling stands: its state, with the profiler's progress."""
        event = model_pb.WatchModelResponse(request_id=request_id, state=model.state)
        progress = None
        if model.state != model_pb.MODEL_STATE_REGISTERED:  # else left from a failed attempt
            progress = await self.store.get_profile_progress(model.model_id)
        if progress is not None:
            event.runs_done, event.runs_total = progress.runs_done, progress.runs_total
            if model.state == model_pb.MODEL_STATE_PROFILING:
                event.current = progress.current
        event.message = (
            model.state_reason
            or (progress.message if progress is not None else "")
            or model_pb.ModelState.Name(model.state)
        )
        return event

    async def GetProfile(self, request, context):
        model = await self._model(request.model_id)
        profile = await self.store.get_profile(request.model_id)
        if profile is None:
            state = state_name(model.state)
            reason = f": {model.state_reason}" if model.state_reason else ""
            raise FailedPrecondition(
                f"model {request.model_id!r} is not profiled yet ({state}{reason})"
            )
        profile.request_id = request.request_id
        return profile

    async def ImportProfiles(self, request, context):
        async with self._register_lock:
            return await import_profiles(self.store, request, self.settings.models_root)
