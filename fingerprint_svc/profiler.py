"""The profiler: a background asyncio task per model in the ModelService process.

``start(model)`` moves the model to PROFILING and runs its jobs (planned by
:mod:`fingerprint_svc.profile_plan`) one at a time across the whole process, so that two
models' jobs never share the CPU and spoil each other's timings. For each job:

1. the fingerprint is cut, or found in the cache (:mod:`fingerprint_svc.fingerprints`),
   in a thread so the event loop keeps serving, and checked to be a cut of the model as
   registered (a checkpoint rewritten or deleted mid-profiling fails the model, or drops
   the variant whose own checkpoint it was, with the reason);
2. devices are chosen on one live node (idle first: lowest load, then most free) and the
   memory each rank needs is reserved with owner ``profile-<model>-<hex>``;
3. ``AgentService.RunProfilingJob`` runs it on that node's agent;
4. the reservation is released, whatever happened.

A job that fails (no room, or the agent's error) fails the model when it belongs to the
base model's (1,1) reference, which every estimate needs; otherwise the rest of that
variant's reference (or, for a variant's (1,1), the whole variant) is skipped and the
agent's message recorded in ``GetProfileResponse.skipped``, so a multi-rank launch the
agent does not support yet, or a compression it refuses, does not cost the model its
profile.

Stored raw with ``store.put_profile``: one ProfileMeasurement per job and output length,
and the cost: wall time from start to finish (cutting fingerprints, and waiting for
another model's jobs, included), device-seconds (for
each job, its devices × the RunProfilingJob call's wall time, worker start-up included)
and the largest peak memory of any one rank. Progress (runs done of runs planned, the
job running now) goes to ``keys.profile_progress`` for WatchModel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc

from fingerprint_svc.fingerprints import Fingerprint, FingerprintCache
from fingerprint_svc.profile_plan import (
    DeviceChoice,
    ProfileJob,
    ProfilingSettings,
    VariantTarget,
    choose_devices,
    compute_bytes_for,
    live_node_devices,
    no_room_reason,
    plan_jobs,
    reference_label,
    room_once_settled,
    variant_targets,
)
from fingerprint_svc.registry import PRECISIONS
from services import health
from services.aio import cancel_and_wait
from services.api import agent_service_pb2 as agent_pb
from services.api import agent_service_pb2_grpc
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.contention import MEASURE_AGAIN_SHARE, contention_note, share_of
from services.engine_rules import check_still_the_model, default_dtype, resolve_checkpoint
from services.errors import (
    CHECKPOINT_UNUSABLE,
    CheckpointChanged,
    CheckpointUnusable,
    WorkerKilled,
    rpc_reason,
)
from services.estimation.profiles import INCOMPLETE, profiled_reason
from services.grpc_server import channel
from services.models.arch import ArchSpec
from services.models.checkpoint import read_config, served_spec
from services.models.families import parse_config
from services.reservation import (
    fingerprint_rank_bytes,
    layer_kv_bytes_per_token,
    layer_weight_bytes,
)
from services.settings import Settings
from services.state.store import ReservationError, StateStore

log = logging.getLogger("iserve.model.profiler")

RESERVE_ATTEMPTS = 3
# How long a job waits for memory held beyond reservations (the previous job's worker
# exiting, measured by a monitor that refreshes about once a second) to be given back.
SETTLE_WAIT_S = 15.0
SETTLE_POLL_S = 0.25
# Beyond the agent's wait for workers to be ready, what a job's timed runs may take.
JOB_RUN_BUDGET_S = 600.0
# How long an agent whose job failed UNAVAILABLE gets to answer a health check.
AGENT_CHECK_S = 1.0
OWNER_PREFIX = "profile-"


class JobFailed(Exception):
    """A job could not run or failed; the message says why. ``agent_gone``: its agent
    stopped answering (killed, restarted); ``worker_gone``: the agent answered that its
    worker was (UNAVAILABLE: killed, or out of memory): either way registering again may
    complete it."""

    def __init__(self, message: str, agent_gone: bool = False, worker_gone: bool = False):
        super().__init__(message)
        self.agent_gone = agent_gone
        self.worker_gone = worker_gone


class _NoCopy(JobFailed):
    """A node's agent could not read the job's checkpoint (none under its own models
    root): another node may have it."""

    def __init__(self, node_id: str, message: str):
        super().__init__(message)
        self.node_id = node_id


class CheckpointMoved(JobFailed):
    """The checkpoint a job cuts its fingerprint from can no longer be read, or is now
    another model than the one registered from it (rewritten or deleted mid-profiling):
    what the rest of the profile would measure is not that model."""


class ProfilingFailed(Exception):
    """The model cannot be profiled; the message becomes its ``state_reason``."""


@dataclass
class ProfileRecord:
    """What one model's profiling gathered so far."""

    measurements: list[model_pb.ProfileMeasurement] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    device_seconds: float = 0.0
    peak_device_bytes: int = 0
    runs_total: int = 0
    # Jobs skipped because their agent stopped answering: the profile is incomplete.
    agent_gone: int = 0
    # Jobs skipped because their worker was gone (the agent answering): incomplete too.
    worker_gone: int = 0
    # Variants dropped because their own checkpoint moved: the profile is incomplete.
    moved: list[str] = field(default_factory=list)


def _incomplete(record: ProfileRecord) -> str:
    """A PROFILED model's reason: what its profile lacks that profiling again (once the
    cause is gone) would measure; empty for a complete profile."""
    parts = []
    if record.agent_gone:
        parts.append(
            f"{record.agent_gone} profiling job(s) failed because an agent stopped answering "
            "(the profile's skipped list names them); register the model again once the "
            "agent is back to complete it"
        )
    if record.worker_gone:
        # A worker killed mid-job read as a complete profile: only the skipped list said
        # a layout was missing, and registering again was refused (a probe).
        parts.append(
            f"{record.worker_gone} profiling job(s) failed because their worker was gone "
            "(UNAVAILABLE: killed, or out of memory; the profile's skipped list names "
            "them); register the model again to complete it"
        )
    if record.moved:
        parts.append(
            f"variant(s) {', '.join(sorted(set(record.moved)))} dropped because their "
            "checkpoint was rewritten or removed during profiling (the profile's skipped "
            "list says how); register the model again to profile them"
        )
    return f"{INCOMPLETE}{'; '.join(parts)}" if parts else ""


def _most_slowed(measurements: list[model_pb.ProfileMeasurement]) -> float:
    """The largest share of the devices' cores other processes took during these
    measurements' runs (0 where not measured)."""
    return max((share_of(m) or 0.0 for m in measurements), default=0.0)


def _owner(model_id: str) -> str:
    return f"{OWNER_PREFIX}{model_id}-{secrets.token_hex(4)}"


class Profiler:
    """Profiles models in the background; one instance per ModelService process."""

    def __init__(
        self, settings: Settings, store: StateStore, profiling: ProfilingSettings | None = None
    ):
        self.settings = settings
        self.store = store
        self.profiling = profiling or ProfilingSettings.from_env()
        self.fingerprints = FingerprintCache(settings.models_root)
        self._tasks: dict[str, asyncio.Task] = {}
        self._turn = asyncio.Lock()  # one job at a time in this process
        self._owners: set[str] = set()  # reservations this process holds

    # ---- lifecycle --------------------------------------------------------------------
    def running(self, model_id: str) -> bool:
        task = self._tasks.get(model_id)
        return task is not None and not task.done()

    async def start(self, model: model_pb.Model) -> None:
        """Record ``model`` as PROFILING and profile it in the background."""
        # Progress before state, here and below: a watcher that sees the new state must
        # find the progress that goes with it.
        await self._progress(model.model_id, 0, 0, "", "waiting to start")
        model.state = model_pb.MODEL_STATE_PROFILING
        model.state_reason = ""
        await self.store.put_model(model)
        task = asyncio.create_task(self._profile(model), name=f"profile:{model.model_id}")
        self._tasks[model.model_id] = task
        task.add_done_callback(lambda t, model_id=model.model_id: self._forget(model_id, t))

    def _forget(self, model_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(model_id) is task:
            del self._tasks[model_id]

    async def cancel(self, model_id: str) -> None:
        """Stop profiling ``model_id`` (its reservations are released); no-op if idle."""
        task = self._tasks.get(model_id)
        if task is not None:
            await cancel_and_wait([task])

    async def forget(self, model: model_pb.Model, remaining: Sequence[model_pb.Model]) -> int:
        """Remove the fingerprints of a deleted ``model`` that none of the ``remaining``
        models profiles on (:meth:`FingerprintCache.release`); the bytes freed."""
        sources = {t.checkpoint_path for t in variant_targets(model)}
        kept = {t.checkpoint_path for m in remaining for t in variant_targets(m)}
        return await asyncio.to_thread(self.fingerprints.release, model.model_id, sources, kept)

    async def close(self) -> None:
        """Stop every profiling task; their models end FAILED (register again to retry)."""
        model_ids = list(self._tasks)
        for model_id in model_ids:
            await self.cancel(model_id)
            await self._fail(model_id, "profiling was interrupted: the model service stopped")

    async def recover(self) -> None:
        """At start-up: models left PROFILING by an earlier process end FAILED, and its
        profiling reservations are released."""
        for model in await self.store.list_models():
            if model.state == model_pb.MODEL_STATE_PROFILING and not self.running(model.model_id):
                await self._fail(
                    model.model_id,
                    "profiling was interrupted: the model service restarted; "
                    "register the model again to retry",
                )
        for owner in await self.store.reservation_owners():
            if owner.startswith(OWNER_PREFIX) and owner not in self._owners:
                await self.store.release(owner)

    # ---- one model --------------------------------------------------------------------
    async def _profile(self, model: model_pb.Model) -> None:
        model_id = model.model_id
        started = time.perf_counter()
        try:
            record = await self._run_all(model)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes the model's reason
            if not isinstance(exc, ProfilingFailed):
                log.exception("profiling %s failed", model_id)
            await self._fail(model_id, str(exc) or type(exc).__name__)
            return
        current = await self.store.get_model(model_id)
        if current is None:
            return
        profile = model_pb.GetProfileResponse(
            model_id=model_id, measurements=record.measurements, skipped=record.skipped
        )
        profile.cost.wall_time_ms = (time.perf_counter() - started) * 1e3
        profile.cost.device_seconds = record.device_seconds
        profile.cost.peak_device_memory_bytes = record.peak_device_bytes
        await self.store.put_profile(profile)
        await self._progress(
            model_id,
            record.runs_total,
            record.runs_total,
            "",
            f"profiled: {len(record.measurements)} measurements, "
            f"{len(record.skipped)} skipped, {profile.cost.device_seconds:.1f} device-seconds",
            model_pb.MODEL_STATE_PROFILED,
        )
        current.state = model_pb.MODEL_STATE_PROFILED
        # An agent lost mid-profiling leaves references unmeasured that a run with it back
        # would measure, and runs other processes slowed measure them high: say so where
        # the model's state is read, not only in the profile.
        current.state_reason = profiled_reason(
            _incomplete(record), contention_note(share_of(m) for m in record.measurements)
        )
        await self.store.put_model(current)
        log.info("profiled %s in %.1f s", model_id, profile.cost.wall_time_ms / 1e3)

    async def _run_all(self, model: model_pb.Model) -> ProfileRecord:
        model_id = model.model_id
        try:
            # A model with a short context is profiled on shorter prompts and outputs.
            profiling = self.profiling.fitted(model.shape.max_position_embeddings)
        except ValueError as exc:
            raise ProfilingFailed(f"{model_id}: {exc}") from None
        nodes = await self.store.list_nodes()
        jobs, skipped = plan_jobs(model, profiling, live_node_devices(nodes))
        record = ProfileRecord(skipped=list(skipped), runs_total=len(jobs))
        given_up: set[tuple[str, tuple[int, int]]] = set()
        dropped_variants: set[str] = set()
        # Nodes whose agent found no copy of a fingerprint under its models root (one of
        # its own, not shared with this service's): this model's jobs go elsewhere.
        lacking: dict[str, str] = {}
        # Each job's measurements: record.measurements[start:end].
        spans: dict[int, tuple[int, int]] = {}
        for done, job in enumerate(jobs):
            variant, reference = job.variant.name, job.reference
            if variant in dropped_variants or (variant, reference) in given_up:
                continue
            if self._turn.locked():
                await self._progress(
                    model_id, done, len(jobs), job.describe(), "waiting for another model's job"
                )
            try:
                async with self._turn:
                    await self._progress(model_id, done, len(jobs), job.describe(), "running")
                    start = len(record.measurements)
                    await self._run_job(model, job, record, profiling, lacking)
                    spans[done] = (start, len(record.measurements))
            except JobFailed as exc:
                record.agent_gone += exc.agent_gone
                record.worker_gone += exc.worker_gone
                moved = isinstance(exc, CheckpointMoved)
                if (reference == (1, 1) or moved) and job.variant.is_base:
                    raise ProfilingFailed(f"{job.describe()}: {exc}") from exc
                if moved:
                    record.moved.append(variant)
                if reference == (1, 1) or moved:
                    dropped_variants.add(variant)
                    record.skipped.append(f"variant {variant}: {job.describe()} failed: {exc}")
                else:
                    given_up.add((variant, reference))
                    record.skipped.append(
                        f"{variant} {reference_label(reference)}: {job.describe()} failed: {exc}"
                    )
                log.info("profiling %s: %s skipped: %s", model_id, job.describe(), exc)
        await self._measure_slowed_again(model, jobs, spans, record, profiling, lacking)
        return record

    async def _measure_slowed_again(
        self,
        model: model_pb.Model,
        jobs: list[ProfileJob],
        spans: dict[int, tuple[int, int]],
        record: ProfileRecord,
        profiling: ProfilingSettings,
        lacking: dict[str, str],
    ) -> None:
        """Run once more, after the others, each job whose kept runs other processes
        took more than MEASURE_AGAIN_SHARE of the cores from (the agent takes the
        quietest of up to twice its runs), and keep whichever measurement they slowed
        less. A slowed job
        measured alone among quiet ones bends the fit: a probe's contended one-layer
        fingerprint put a pipeline stage at minus 3 ms, and min-latency deployed the
        slowest layout it measured."""
        slowed_jobs = [
            (i, jobs[i])
            for i, (start, end) in sorted(spans.items())
            if _most_slowed(record.measurements[start:end]) > MEASURE_AGAIN_SHARE
        ]
        if not slowed_jobs:
            return
        total = len(jobs) + len(slowed_jobs)
        record.runs_total = total
        for n, (i, job) in enumerate(slowed_jobs):
            trial = ProfileRecord()
            try:
                async with self._turn:
                    await self._progress(
                        model.model_id,
                        len(jobs) + n,
                        total,
                        job.describe(),
                        "measuring again: other processes slowed its runs",
                    )
                    await self._run_job(model, job, trial, profiling, lacking)
            except CheckpointMoved as exc:
                # As in the first round: what the rest would measure is not that model.
                raise ProfilingFailed(f"{job.describe()}: {exc}") from exc
            except JobFailed as exc:  # the first measurement stands
                log.info(
                    "profiling %s: %s not measured again: %s", model.model_id, job.describe(), exc
                )
                continue
            record.device_seconds += trial.device_seconds
            record.peak_device_bytes = max(record.peak_device_bytes, trial.peak_device_bytes)
            start, end = spans[i]
            first = record.measurements[start:end]
            if len(trial.measurements) == len(first) and _most_slowed(
                trial.measurements
            ) < _most_slowed(first):
                record.measurements[start:end] = trial.measurements

    async def _fingerprint(
        self, model: model_pb.Model, variant: VariantTarget, num_layers: int
    ) -> Fingerprint:
        return await asyncio.to_thread(self._cut_from_the_model, model, variant, num_layers)

    def _cut_from_the_model(
        self, model: model_pb.Model, variant: VariantTarget, num_layers: int
    ) -> Fingerprint:
        """The fingerprint, checked to be a cut of the model as registered: its checkpoint
        is read afresh for every job (a cached fingerprint is keyed by the checkpoint's
        content), so one rewritten or deleted since registering is found at the next job
        (CheckpointMoved) instead of being measured as the model."""
        path = variant.checkpoint_path
        again = "register the model again (after `iserve model delete`, or as a new model id)"
        try:
            # Inside the models root still: a file made a link to one outside since
            # registration was cut into the fingerprint and read.
            resolve_checkpoint(self.settings.models_root, path)
            parse_config(read_config(self.settings.models_root / path))
        except (OSError, ValueError, CheckpointUnusable) as exc:
            raise CheckpointMoved(
                f"checkpoint {path!r} can no longer be read ({exc}): it was moved, deleted "
                f"or rewritten since the model was registered; {again}"
            ) from exc
        try:
            fingerprint = self.fingerprints.fingerprint(path, num_layers, model.model_id)
            cut = read_config(self.settings.models_root / fingerprint.checkpoint_path)
        except ValueError as exc:
            # Its weights no longer read as the checkpoint registered (a file truncated
            # or rewritten since): not this job's trouble alone.
            raise CheckpointMoved(
                f"checkpoint {path!r} no longer reads as registered: cannot cut the "
                f"fingerprint: {exc}; {again}"
            ) from exc
        except OSError as exc:  # the fingerprint cache's disk (full, unwritable)
            raise JobFailed(f"cannot cut the fingerprint: {exc}") from exc
        registered = model_pb.ModelShape()
        registered.CopyFrom(model.shape)
        registered.num_layers = fingerprint.num_layers  # a cut has fewer; the rest is the same
        try:
            check_still_the_model(path, cut, registered)
        except CheckpointChanged as exc:
            raise CheckpointMoved(str(exc)) from exc
        return fingerprint

    async def _run_job(
        self,
        model: model_pb.Model,
        job: ProfileJob,
        record: ProfileRecord,
        profiling: ProfilingSettings,
        lacking: dict[str, str],
    ) -> None:
        """Run ``job`` on a node not in ``lacking``, adding each node found without a
        copy of the checkpoint to it (node id: its agent's words), and record its runs."""
        fingerprint = await self._fingerprint(model, job.variant, job.num_layers)
        spec = await asyncio.to_thread(self._spec_of, fingerprint)
        while True:
            try:
                reply, choice, wall_s = await self._run_on_a_node(
                    model, job, fingerprint, spec, profiling, lacking
                )
                break
            except _NoCopy as exc:
                lacking[exc.node_id] = str(exc)
                log.info("profiling %s: %s; trying another node", model.model_id, exc)
        record.device_seconds += wall_s * job.ranks
        self._record(model, job, fingerprint, profiling, record, reply, choice)

    async def _run_on_a_node(
        self,
        model: model_pb.Model,
        job: ProfileJob,
        fingerprint: Fingerprint,
        spec: ArchSpec,
        profiling: ProfilingSettings,
        lacking: dict[str, str],
    ) -> tuple[agent_pb.RunProfilingJobResponse, DeviceChoice, float]:
        """(reply, device choice, wall seconds) of the job run on devices of a node not
        in ``lacking``; _NoCopy when that node's agent has no copy of the checkpoint."""
        owner = _owner(model.model_id)
        self._owners.add(owner)
        try:
            choice = await self._reserve(owner, job, spec, profiling, lacking)
        except BaseException:
            self._owners.discard(owner)
            raise
        try:
            request = agent_pb.RunProfilingJobRequest(
                request_id=owner,
                checkpoint_path=fingerprint.checkpoint_path,
                config=job.config(),
                workers=job.worker_specs(choice.device_ids),
                input_tokens=profiling.input_tokens[0],
                extra_input_tokens=profiling.input_tokens[1:],
                output_tokens=profiling.output_tokens,
                warmup_runs=profiling.warmup_runs,
                timed_runs=profiling.timed_runs,
                # The layers are timed with the full model's cache footprint.
                model_layers=model.shape.num_layers,
            )
            started = time.perf_counter()
            async with channel(choice.agent_address) as ch:
                try:
                    reply = await agent_service_pb2_grpc.AgentServiceStub(ch).RunProfilingJob(
                        request, timeout=self.settings.ready_timeout_s + JOB_RUN_BUDGET_S
                    )
                except grpc.RpcError as exc:
                    said = f"{exc.code().name}: {exc.details()}"
                    if rpc_reason(exc) == CHECKPOINT_UNUSABLE:
                        raise _NoCopy(choice.node_id, said) from exc
                    gone = exc.code() == grpc.StatusCode.UNAVAILABLE and not (
                        await asyncio.to_thread(health.check, choice.agent_address, AGENT_CHECK_S)
                    )
                    if gone:
                        # The agent itself is gone (killed, restarted): say which, and
                        # that registering again retries once it is back.
                        said = (
                            f"the agent of node {choice.node_id} ({choice.agent_address}) "
                            f"stopped answering ({said}); register the model again once "
                            "it is back"
                        )
                    # Its worker killed (by hand, or the kernel's out-of-memory killer):
                    # UNAVAILABLE once it served, WorkerKilled before it was ready.
                    worker_gone = not gone and (
                        exc.code() == grpc.StatusCode.UNAVAILABLE
                        or rpc_reason(exc) == WorkerKilled.reason
                    )
                    if not fingerprint.full_model and fingerprint.checkpoint_path in said:
                        # The worker names what it loaded: say what that was cut from.
                        said += (
                            f" ({fingerprint.checkpoint_path} is the {fingerprint.num_layers}-"
                            f"layer fingerprint cut from checkpoint {job.variant.checkpoint_path!r})"
                        )
                    raise JobFailed(said, agent_gone=gone, worker_gone=worker_gone) from exc
            wall_s = time.perf_counter() - started
        finally:
            await self.store.release(owner)
            self._owners.discard(owner)
        return reply, choice, wall_s

    def _record(
        self,
        model: model_pb.Model,
        job: ProfileJob,
        fingerprint: Fingerprint,
        profiling: ProfilingSettings,
        record: ProfileRecord,
        reply: agent_pb.RunProfilingJobResponse,
        choice: DeviceChoice,
    ) -> None:
        """The job's runs as the record's measurements."""
        hardware = choice.devices[0].hardware_type
        # The precision the workers computed in (the job asks for none): what a layer's
        # weights and a token's KV took, and what this measurement describes.
        measured = job.config()
        measured.dtype = default_dtype(
            model.shape.dtype, cuda=choice.devices[0].kind == common.DEVICE_KIND_CUDA
        )
        for run in reply.runs:
            record.measurements.append(
                model_pb.ProfileMeasurement(
                    variant_name=job.variant.name,
                    num_layers=fingerprint.num_layers,
                    full_model=fingerprint.full_model,
                    config=measured,
                    stage_layers=job.stage_layers,
                    # An agent that predates extra_input_tokens ran input_tokens alone.
                    input_tokens=run.input_tokens or profiling.input_tokens[0],
                    output_tokens=run.output_tokens,
                    ttft_ms=run.ttft_ms,
                    tpot_ms=run.tpot_ms,
                    latency_ms=run.latency_ms,
                    peak_memory_bytes_per_rank=run.peak_memory_bytes_per_rank,
                    ttft_layer_ms=run.ttft_layer_ms,
                    tpot_layer_ms=run.tpot_layer_ms,
                    layer_weight_bytes=layer_weight_bytes(model.shape, measured),
                    layer_kv_bytes_per_token=layer_kv_bytes_per_token(model.shape, measured),
                    repetitions=profiling.timed_runs,
                    hardware_type=hardware,
                    other_cpu_share=share_of(run),
                )
            )
            record.peak_device_bytes = max(
                record.peak_device_bytes, *run.peak_memory_bytes_per_rank, 0
            )

    def _spec_of(self, fingerprint: Fingerprint) -> ArchSpec:
        # As served: a head of its own under a config that ties it is reserved for.
        return served_spec(self.settings.models_root / fingerprint.checkpoint_path)

    async def _reserve(
        self,
        owner: str,
        job: ProfileJob,
        spec: ArchSpec,
        profiling: ProfilingSettings,
        lacking: Mapping[str, str] = MappingProxyType({}),
    ):
        """Reserve each rank's memory on the best devices of a node not in ``lacking``
        (node id: why its agent could not read the checkpoint); JobFailed when none fit.
        Memory in use beyond the reservations (the job before's worker still exiting) is
        waited for, up to SETTLE_WAIT_S; nothing else is."""
        settle_by = time.monotonic() + SETTLE_WAIT_S
        attempt = 0
        while True:
            nodes = [n for n in await self.store.list_nodes() if n.node_id not in lacking]
            said = "; ".join(f"node {n}: {why}" for n, why in sorted(lacking.items()))
            if lacking and not any(n.alive for n in nodes):
                raise JobFailed(f"no live node has a copy of the checkpoint ({said})")
            compute = compute_bytes_for(nodes, PRECISIONS.get(spec.torch_dtype, 0))
            need = fingerprint_rank_bytes(
                spec,
                tensor_parallel=job.tensor_parallel,
                stage_layers=job.stage_layers,
                batch_size=job.batch_size,
                max_seq_len=profiling.max_seq_len,
                compute_bytes=compute,
            )
            choice = choose_devices(nodes, need)
            if choice is None:
                if time.monotonic() < settle_by and room_once_settled(nodes, need):
                    await asyncio.sleep(SETTLE_POLL_S)
                    continue
                without = f" (and no copy of the checkpoint on {said})" if lacking else ""
                raise JobFailed(no_room_reason(nodes, need) + without)
            try:
                await self.store.reserve(
                    owner,
                    {(choice.node_id, d): n for d, n in zip(choice.device_ids, need, strict=True)},
                )
                return choice
            except ReservationError as exc:
                attempt += 1  # taken between listing and reserving; look again
                if attempt >= RESERVE_ATTEMPTS:
                    raise JobFailed(f"cannot reserve memory: {exc}") from None

    # ---- records ----------------------------------------------------------------------
    async def _fail(self, model_id: str, reason: str) -> None:
        log.warning("profiling %s failed: %s", model_id, reason)
        with contextlib.suppress(Exception):  # Redis trouble must not hide the cause
            model = await self.store.get_model(model_id)
            if model is None:
                return
            progress = await self.store.get_profile_progress(model_id)
            done, total = (progress.runs_done, progress.runs_total) if progress else (0, 0)
            await self._progress(model_id, done, total, "", reason, model_pb.MODEL_STATE_FAILED)
            model.state = model_pb.MODEL_STATE_FAILED
            model.state_reason = reason
            await self.store.put_model(model)

    async def _progress(
        self,
        model_id: str,
        done: int,
        total: int,
        current: str,
        message: str,
        state: int = model_pb.MODEL_STATE_PROFILING,
    ) -> None:
        await self.store.put_profile_progress(
            model_id,
            model_pb.WatchModelResponse(
                state=state, runs_done=done, runs_total=total, current=current, message=message
            ),
        )
