"""The estimator's work against iserve's state: load what a request needs from Redis,
keep the configuration maps current, fit and store calibrations.

The decisions live in the pure modules (``profiles``, ``extrapolation``, ``config_map``,
``calibration``, ``ranking``); this module only fetches, caches and stores. CPU-heavy steps (building a
map, fitting a calibration) run in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from estimator_svc import calibration_message
from estimator_svc.config_map import ConfigMap, build_config_map, from_json, source_hash
from estimator_svc.config_map import to_json as config_map_json
from estimator_svc.hardware_calibration import fit_hardware_calibration
from estimator_svc.messages import config_of
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.engine_rules import default_dtype
from services.errors import FailedPrecondition, InvalidArgument, NotFound
from services.estimation import model_references, profiles
from services.estimation.latency import REFERENCE_LAYOUTS
from services.estimation.memory import GIB
from services.estimation.model_references import Workload
from services.estimation.score import Estimates, unfit_note
from services.ids import check_hardware_type, is_cpu_hardware
from services.proto_limits import MAX_DEVICE_BYTES
from services.reservation import CPU_RUNTIME_MIB, RUNTIME_OVERHEAD_BYTES, even_split_bytes
from services.state.capacity import largest_device_bytes
from services.state.store import StateStore

__all__ = ["DEFAULT_DEVICES", "Estimator", "Estimate"]

log = logging.getLogger(__name__)

# Devices assumed for a hardware type the cluster has none of (imported measurements).
DEFAULT_DEVICES = 8


@dataclass(frozen=True)
class Estimate:
    """Every configuration estimated for one request, and how it was estimated."""

    estimates: Estimates
    workload: Workload
    devices: int
    config_map: ConfigMap
    # The request left input_tokens unset: ``workload`` holds the profiled prompt's.
    input_defaulted: bool = False
    # The memory of each device what fits was judged against (None: unknown, all fit).
    device_memory_gib: float | None = None
    # The model's reason when its profile is incomplete (profiles.INCOMPLETE): its
    # estimates stand on fewer layouts than they would (a probe: only `iserve models`
    # said so, and a plan picked a layout whose communication was never measured).
    incomplete: str | None = None

    @property
    def usable(self) -> np.ndarray:
        """Indices of the configurations with a usable estimate (the others are left out)."""
        return np.flatnonzero(self.estimates.estimable)

    @property
    def communication_unprofiled(self) -> np.ndarray:
        """Per configuration, whether it splits the model a way the fingerprints never ran
        (its communication is left out of its estimate)."""
        space = self.estimates.space
        return self.config_map.references.communication_unprofiled(space.tp, space.pp)

    @property
    def notes(self) -> list[str]:
        """How the profile limits the estimates (and this workload's prompt length), then
        what was left out and why."""
        references = self.config_map.references
        length = self.workload.input_tokens
        profiled = any(p.input_tokens == length for p in references.prompts)
        defaulted = (
            f"no input_tokens given: estimated for a {length}-token prompt, "
            + (
                "the longest profiled that leaves room for the output"
                if profiled
                else "what the model's context leaves beside the output (every profiled "
                "prompt is longer)"
            )
            + "; give the prompt length of your requests"
            if self.input_defaulted
            else None
        )
        # On a CPU the profile's memory is the engine's own account; what the system
        # shows a worker using (`iserve status` USED) adds its process's runtime.
        runtime = (
            "memory is the engine's (weights, KV cache, activations, as profiled); each "
            f"worker process also holds about {CPU_RUNTIME_MIB} MiB of Python and torch "
            "runtime, which `iserve status` USED counts (the deployer reserves "
            f"{RUNTIME_OVERHEAD_BYTES >> 20} MiB a rank for it)"
            if is_cpu_hardware(self.config_map.hardware_type)
            else None
        )
        extra = (
            defaulted,
            references.prompt_note(self.workload.input_tokens),
            references.batch_note(
                self.workload.batch_size,
                measured_growth=bool(self.config_map.constants[0].tpot_batch_growth),
            ),
            runtime,
            self.estimates.unestimable_note(),
        )
        return [*filter(None, [self.incomplete]), *references.notes, *(n for n in extra if n)]

    @property
    def unfit_note(self) -> str | None:
        """How many usable configurations need more memory per device than a device
        holds: listed beside the others, they were told apart by nothing (a 405B model's
        764 GiB per device on 48 GB devices: a probe). A ranking says it on its own."""
        e = self.estimates
        unfit = int(np.count_nonzero(e.estimable & ~e.fits))
        if not unfit or self.device_memory_gib is None:
            return None
        return (
            f"{unfit_note(unfit)} of {self.device_memory_gib:.3g} GiB "
            "(fits_device_memory false; `iserve estimate` marks each)"
        )


def reserved_fits(
    estimates: Estimates,
    shape: model_pb.ModelShape,
    workload: Workload,
    device_memory_gib: float | None,
    *,
    cuda: bool,
) -> Estimates:
    """``estimates`` whose ``fits`` says what the deployer will place on devices of
    ``device_memory_gib`` each: a configuration the estimate alone fits fits only when
    its even split as the deployer reserves it does (:func:`even_split_bytes`: a layer's
    block the estimate's or the shape's, whichever is larger, beside the runtime, the
    embedding and LM head and a prefill's activations, on the stage with the most
    layers). One owner of "fits": a 70B int4 estimate of 33.8 GiB a device was marked as
    fitting 34 GiB devices the deployer then refused at 36.1 GiB (a tester)."""
    if device_memory_gib is None or shape.num_layers <= 0:
        return estimates
    dtype = default_dtype(shape.dtype, cuda=cuda)
    max_seq_len = workload.input_tokens + workload.output_tokens
    reserved = np.full(estimates.space.size, np.nan)
    for i in np.flatnonzero(estimates.estimable).tolist():
        config = config_of(estimates.space, i)
        config.dtype = dtype
        total = round(float(estimates.memory_total_gib[i]) * GIB)
        reserved[i] = even_split_bytes(shape, config, max_seq_len, total) / GIB
    fits = estimates.fits & ~(reserved > device_memory_gib)  # NaN: as the estimate says
    return dataclasses.replace(estimates, fits=fits, reserved_per_device_gib=reserved)


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1e3, UTC).strftime("%Y-%m-%d %H:%M UTC")


class Estimator:
    """Estimation requests against one store."""

    def __init__(self, store: StateStore, shipped_dir: Path = calibration_message.SHIPPED_DIR):
        self.store = store
        self.shipped_dir = shipped_dir

    # ---- calibrations -------------------------------------------------------------
    async def get_calibration(self, hardware_type: str) -> estimator_pb.Calibration:
        """The calibration in Redis, else the one shipped with iserve; NotFound otherwise."""
        check_hardware_type(hardware_type)
        stored = await self.store.get_calibration(hardware_type)
        if stored is not None:
            return stored
        shipped = calibration_message.load_shipped(hardware_type, self.shipped_dir)
        if shipped is None:
            raise NotFound(
                f"no calibration for {hardware_type!r}: run `iserve calibrate --hardware "
                f"{hardware_type}` on full-model measurements of that hardware"
            )
        return shipped

    async def calibrate(
        self, hardware_type: str, model_ids: Sequence[str] = ()
    ) -> estimator_pb.Calibration:
        """Fit ``hardware_type``'s constants on the full-model runs stored for it (of
        ``model_ids``, or of every model that has some) and store them."""
        check_hardware_type(hardware_type)
        entries = await self._calibration_entries(hardware_type, model_ids)
        now_ms = int(time.time() * 1000)
        device_memory = await self._device_memory_bytes(hardware_type)
        try:
            current = calibration_message.from_proto(await self.get_calibration(hardware_type))
        except NotFound:
            current = None
        if not device_memory and current is not None:
            # No such devices here (imported measurements): keep what the current one says.
            device_memory = current.device_memory_bytes
        try:
            fitted, table = await asyncio.to_thread(
                fit_hardware_calibration, hardware_type, entries, "", now_ms, device_memory
            )
        except ValueError as exc:
            raise FailedPrecondition(f"cannot calibrate {hardware_type}: {exc}") from None
        if fitted.primary.tpot_batch_growth:
            swept = [
                m for m, _, samples in entries if any(s.full_model and s.batch > 1 for s in samples)
            ]
            growth_said = f"; decode's batch growth from the batch sweeps of {', '.join(swept)}"
        elif current is not None and current.primary.tpot_batch_growth:
            # Runs without a batch sweep say nothing of it: the hardware's measured growth
            # stays (dropped, a batch of 256 decoded as fast as one again: a tester).
            fitted = fitted.with_batch_growth(current.primary.tpot_batch_growth)
            growth_said = (
                "; decode's batch growth kept from the previous calibration (these runs have "
                "no batch sweep)"
            )
        else:
            growth_said = "; no batch sweep: decode grows only as batch-2 profiles say"
        counts = {m: int((table.models == m).sum()) for m, _, _ in entries}
        fitted_on = [m for m, n in counts.items() if n]
        sources = set()
        for model_id in fitted_on:
            sources |= await self._sources(model_id, hardware_type)
        message = calibration_message.to_proto(fitted)
        message.provenance = (
            f"fitted by Calibrate on {table.size} full-model runs on {hardware_type} "
            "(batch 1, balanced stages) of "
            + ", ".join(f"{m} ({counts[m]})" for m in fitted_on)
            + f"; measurements from {'; '.join(sorted(sources))}"
            + "; references extrapolated from the same models' fingerprints"
            + (
                "; only the reference layouts were measured, so alpha..delta are not "
                "identified by these runs (they stay near their starting values)"
                if set(zip(table.tp, table.pp, strict=True)) <= set(REFERENCE_LAYOUTS)
                else ""
            )
            + growth_said
            + f"; {_utc(now_ms)}"
        )
        await self.store.put_calibration(message)
        return message

    async def _calibration_entries(
        self, hardware_type: str, model_ids: Sequence[str]
    ) -> list[tuple[str, model_references.ModelReferences, list[profiles.Sample]]]:
        """(model id, references, samples) of every model to calibrate on. Named models
        must exist and have full-model runs that can be used; otherwise models without
        them are passed over."""
        if model_ids:
            models = [await self._model(model_id) for model_id in dict.fromkeys(model_ids)]
        else:
            models = await self.store.list_models()
        entries = []
        for model in models:
            rows = await self._rows(model.model_id, hardware_type)
            try:
                if not any(m.full_model for m in rows):
                    raise ValueError(f"no full-model measurements on {hardware_type}")
                samples = [profiles.sample_from_measurement(m) for m in rows]
                refs = model_references.model_references(
                    profiles.estimation_shape(model),
                    profiles.estimation_variants(model, rows),
                    samples,
                )
            except ValueError as exc:
                if model_ids:
                    raise FailedPrecondition(f"model {model.model_id!r}: {exc}") from None
                continue
            entries.append((model.model_id, refs, samples))
        if not entries:
            raise FailedPrecondition(
                f"no full-model measurements stored for {hardware_type} (with fingerprint runs "
                "of the same models to extrapolate from); import or profile some first"
            )
        return entries

    async def _sources(self, model_id: str, hardware_type: str) -> set[str]:
        raw = (await self.store.get_profile_sources(model_id)).get(hardware_type)
        if raw is None:
            return {"iserve profiling"}
        source = json.loads(raw)
        return {f"{source['format']} import of {', '.join(source['files'])}"}

    # ---- configuration maps -------------------------------------------------------
    async def _model(self, model_id: str) -> model_pb.Model:
        return await self.store.require_model(model_id)

    async def _rows(self, model_id: str, hardware_type: str) -> list[model_pb.ProfileMeasurement]:
        profile = await self.store.get_profile(model_id)
        if profile is None:
            return []
        return [m for m in profile.measurements if m.hardware_type == hardware_type]

    async def config_map(
        self, model_id: str, hardware_type: str, model: model_pb.Model | None = None
    ) -> ConfigMap:
        """The model's configuration map on ``hardware_type``: the stored one while its
        sources are unchanged, else rebuilt and stored. ``model``: its record, when the
        caller read it already."""
        check_hardware_type(hardware_type)
        model = model or await self._model(model_id)
        profile = await self.store.get_profile(model_id)
        measurements = list(profile.measurements) if profile is not None else []
        rows = [m for m in measurements if m.hardware_type == hardware_type]
        if not rows:
            others = sorted({m.hardware_type for m in measurements})
            if not others:
                # Said as `iserve estimate` says it: a model still profiling read as one
                # profiled on "nothing yet".
                state = model_pb.ModelState.Name(model.state).removeprefix("MODEL_STATE_")
                what = (
                    "wait for its profile (`iserve models` shows its progress)"
                    if model.state == model_pb.MODEL_STATE_PROFILING
                    else f"profile it (`iserve register {model_id} "
                    f"{model.checkpoint_path or 'CHECKPOINT'}` again, without "
                    "--skip-profiling) or import measurements (iserve profile import)"
                )
                raise FailedPrecondition(
                    f"model {model_id!r} is not profiled yet ({state}"
                    + (f": {model.state_reason}" if model.state_reason else "")
                    + f"): {what}"
                )
            raise FailedPrecondition(
                f"model {model_id!r} is not profiled on {hardware_type}; profiled on: "
                + ", ".join(others)
            )
        try:
            calibration = await self.get_calibration(hardware_type)
        except NotFound as exc:
            raise FailedPrecondition(str(exc)) from None
        current = source_hash(model, rows, calibration)
        stored = await self.store.get_config_map(model_id, hardware_type)
        if stored is not None:
            try:
                cached = from_json(stored)
            except ValueError as exc:
                log.info(
                    "rebuilding the configuration map of %s on %s: %s", model_id, hardware_type, exc
                )
            else:
                if cached.source_hash == current:
                    return cached
        try:
            built = await asyncio.to_thread(
                build_config_map, model, rows, calibration, hardware_type, int(time.time() * 1000)
            )
        except ValueError as exc:
            raise FailedPrecondition(
                f"model {model_id!r} on {hardware_type}: the profile cannot be extrapolated: {exc}"
            ) from None
        await self.store.put_config_map(model_id, hardware_type, config_map_json(built))
        return built

    # ---- devices ------------------------------------------------------------------
    async def _device_memory_bytes(self, hardware_type: str) -> int:
        return largest_device_bytes(await self.store.list_nodes(), hardware_type)

    async def devices(self, hardware_type: str, requested: int) -> tuple[int, float | None]:
        """(device count, memory per device in GiB or None) for a request.

        ``requested`` 0 means the cluster's live devices of that type, or
        :data:`DEFAULT_DEVICES` when it has none; memory is the largest such device's
        (None when there is none: :meth:`estimate` then asks the calibration).
        """
        nodes = await self.store.list_nodes()
        present = sum(d.hardware_type == hardware_type for n in nodes if n.alive for d in n.devices)
        count = requested or present or DEFAULT_DEVICES
        if count < 1:
            raise InvalidArgument(f"device_count must be at least 1, got {count}")
        memory = largest_device_bytes(nodes, hardware_type)
        return count, (memory / GIB if memory else None)

    # ---- estimates ----------------------------------------------------------------
    async def estimate(
        self,
        model_id: str,
        hardware_type: str,
        workload: Workload,
        device_count: int,
        device_memory_bytes: int = 0,
    ) -> Estimate:
        """Every configuration of ``model_id`` on ``hardware_type`` for ``workload``, on
        ``device_count`` devices of ``device_memory_bytes`` each (0: see :meth:`devices`)."""
        if device_memory_bytes > MAX_DEVICE_BYTES:
            raise InvalidArgument(
                f"device_memory_bytes {device_memory_bytes} is over {MAX_DEVICE_BYTES} "
                "(1 PiB), more than any device holds"
            )
        model = await self._model(model_id)
        config_map = await self.config_map(model_id, hardware_type, model)
        devices, memory_gib = await self.devices(hardware_type, device_count)
        if device_memory_bytes:
            memory_gib = device_memory_bytes / GIB
        if memory_gib is None:
            known = calibration_message.from_proto(config_map.calibration).device_memory_bytes
            memory_gib = known / GIB if known else None
        estimates, resolved = config_map.estimate(workload, devices, memory_gib)
        cuda = not is_cpu_hardware(hardware_type)
        estimates = reserved_fits(estimates, model.shape, resolved, memory_gib, cuda=cuda)
        incomplete = profiles.incomplete_part(model.state_reason)
        return Estimate(
            estimates,
            resolved,
            devices,
            config_map,
            input_defaulted=not workload.input_tokens,
            device_memory_gib=memory_gib,
            incomplete=f"the model's profile is {incomplete}" if incomplete else None,
        )
