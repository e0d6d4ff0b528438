"""Profiling jobs on this node: start a checkpoint's workers, time generations, stop them.

One RunProfilingJob request profiles one checkpoint (usually a fingerprint) under one
configuration (tp, pp, compression, batch size) at one or more prompt lengths
(``input_tokens``, then ``extra_input_tokens`` in ascending order) and one or more output
lengths:

1. The workers start as a temporary deployment ``profile-<uuid>`` through the same path
   as a deployment (:func:`monitor_agent.launch.build_plan` and the supervisor), with the
   request's WorkerSpecs (ranks, stages and layer ranges; every rank on this node, so the
   supervisor picks the rendezvous port), ``max_batch`` = the config's batch size and
   ``max_seq_len`` = longest prompt + longest output, so the static KV cache holds
   exactly the tokens profiled. With ``model_layers`` (the profiler sends the
   registered model's), each worker on a CPU times its stage's layers with the cache
   footprint of the full model's stage (``monitor_agent.engine.footprint``): a
   fingerprint's few layers would otherwise sit in the last-level cache, which the full
   model's do not.
2. For each prompt length, shortest first, and each output length: ``warmup_runs``
   untimed runs, then ``timed_runs`` timed ones.
   A run opens ``batch_size`` Generate streams on rank 0 at once (the worker batches
   them continuously), each with the same prompt of that many token ids, greedy
   sampling and ``ignore_eos``, so every stream yields exactly the output length.
   Per stream, from the agent's own timestamps (``time.perf_counter`` at the call and at
   each message's arrival): TTFT = first token − call start, TPOT = mean gap between
   tokens after the first, latency = end of stream − call start. A run's TTFT and TPOT
   are the means over its streams and its latency the longest stream's (the batch is
   done when its last sequence is). Around each timed run the agent also reads rank 0's
   layer clock (``GetWorkerStats``): the time one decoder layer took in the run's
   prefill and decode steps, measured inside the worker. The ProfiledRun holds the
   medians over timed runs. On CPU devices the agent also reads, around each timed
   run, how much of the devices' cores other processes used (``/proc/stat`` less the
   workers' and its own CPU time); a run ``services.contention.slowed`` says slowed is
   taken again, up to RUNS_PER_TIMED_RUN times the timed runs (not after a measurement,
   of this job or an earlier one, that got too few quiet runs even so, until one's
   timed runs are all quiet again),
   the runs the others took least from are kept, and their median share is
   ``other_cpu_share``.
3. Peak memory per rank, read after each output length's runs (a peak: it covers the
   runs before it, which is why prompts go shortest first). Rank 0: its
   ``GetWorkerStats.peak_memory_bytes`` (the engine's account of weights, KV cache and
   peak activations on CPU, the activations measured with torch's profiler; the CUDA
   allocator's peak on GPUs). The other ranks serve no RPCs; each measures itself the
   same way and writes the figure into its ready record as its steps run
   (``peak_memory_bytes``, monitor_agent.worker.follower), so that a split layout's
   ranks are counted alike: a rank's RSS growth held allocations outside torch's
   (communication buffers, the allocator's slack) that rank 0's figure leaves out, and
   read about twice rank 0's figure for the same work. A rank that wrote none (an
   engine without that record) is measured by what the agent can see: its own account
   of weights and KV cache (``WorkerInfo.resident_bytes``) plus how much its process's
   memory peak grew during the runs, on CPU the kernel's peak resident set (``VmHWM``
   in ``/proc/<pid>/status``) now minus when the runs started, the peak first reset to
   the resident set then (``clear_refs``, Linux 4.0 and later) so that a peak the load
   set hides no growth below it; on CUDA the process's device memory as NVML reports it,
   likewise as growth. Neither figure counts the Python and torch runtime (about
   330 MiB per process on CPU).
4. The workers are stopped and their records deleted whatever happened, also when the
   call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from monitor_agent.devices import DeviceSpec
from monitor_agent.engine.layer_clock import clocked_layers
from monitor_agent.launch import build_plan
from monitor_agent.supervisor import WorkerSupervisor
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.contention import slowed
from services.errors import IServeError, RemoteError, require
from services.grpc_server import channel
from services.models.arch import ArchSpec
from services.models.checkpoint import read_config
from services.models.families import parse_config
from services.proto_limits import UINT32_MAX
from services.settings import MAX_PROFILE_DECODE_STEPS, MAX_PROFILE_LENGTHS, MAX_PROFILE_RUNS
from services.token_limits import check_batch_size

log = logging.getLogger("iserve.agent.profiling")
# A profiling job's worker records expire this long after their last write: longer
# than any job runs (its workers' start, then its timed runs).
RECORDS_EXPIRE_S = 3600.0

DEFAULT_TIMED_RUNS = 3
# Runs of one measurement at most, as a multiple of its timed runs, while runs slowed by
# other processes (services.contention) are taken again.
RUNS_PER_TIMED_RUN = 2
_NS_PER_TICK = 1_000_000_000 // os.sysconf("SC_CLK_TCK")  # /proc/stat counts ticks
# Longest a single profiling stream may take before the job gives up.
STREAM_TIMEOUT_S = 300.0
STATS_TIMEOUT_S = 10.0
_PROMPT_SEED = 20240531


@dataclass(frozen=True)
class JobSpec:
    """What a RunProfilingJob request asks for, checked."""

    input_tokens: tuple[int, ...]  # ascending, distinct
    output_tokens: tuple[int, ...]
    warmup_runs: int
    timed_runs: int
    batch_size: int

    @property
    def max_seq_len(self) -> int:
        return max(self.input_tokens) + max(self.output_tokens)


@dataclass(frozen=True)
class StreamTiming:
    """One Generate stream as the agent saw it, in milliseconds."""

    ttft_ms: float
    tpot_ms: float
    latency_ms: float


# The profiling jobs' worker logs kept, the newest: a registration runs dozens of jobs,
# and each left its workers' logs in the logs directory for good (a tester counted 65
# after two registrations).
KEPT_JOB_LOGS = 64


def prune_job_logs(log_dir: Path, keep: int = KEPT_JOB_LOGS) -> list[Path]:
    """Remove all but the ``keep`` newest profiling-job worker logs in ``log_dir``;
    returns those removed."""
    logs = []
    for path in log_dir.glob("worker-profile-*.log*"):
        with contextlib.suppress(OSError):  # removed meanwhile
            logs.append((path.stat().st_mtime_ns, path))
    logs.sort(reverse=True)
    removed = [path for _, path in logs[keep:]]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def check_job(request: agent_pb.RunProfilingJobRequest) -> JobSpec:
    """The job ``request`` describes; InvalidArgument for what a caller got wrong.
    ``timed_runs`` 0 means DEFAULT_TIMED_RUNS and ``config.batch_size`` 0 means 1."""
    require(request.input_tokens >= 1, "input_tokens must be at least 1")
    # Bounds on the work: a fuzzing tester's job of 2^32 runs held its devices until
    # the caller's deadline.
    for name, runs in (("warmup_runs", request.warmup_runs), ("timed_runs", request.timed_runs)):
        require(runs <= MAX_PROFILE_RUNS, f"{name} must be at most {MAX_PROFILE_RUNS}, got {runs}")
    for name, lengths in (
        ("output_tokens", request.output_tokens),
        ("extra_input_tokens", request.extra_input_tokens),
    ):
        require(
            len(lengths) <= MAX_PROFILE_LENGTHS,
            f"{name} has {len(lengths)} lengths; a job measures at most {MAX_PROFILE_LENGTHS}",
        )
    check_batch_size(request.config.batch_size, "config.batch_size")
    require(
        all(n >= 1 for n in request.extra_input_tokens),
        "every extra_input_tokens value must be at least 1",
    )
    prompts = (request.input_tokens, *request.extra_input_tokens)
    require(
        list(prompts) == sorted(set(prompts)),
        "input_tokens then extra_input_tokens must ascend without repeats "
        f"(got {', '.join(map(str, prompts))}): a run's peak memory covers the runs before it",
    )
    require(len(request.output_tokens) > 0, "output_tokens is empty: give at least one length")
    require(
        all(o >= 1 for o in request.output_tokens), "every output_tokens value must be at least 1"
    )
    # The sequence length travels as a uint32 (StartWorkersRequest.max_seq_len); the
    # model's own context is checked once its config is read.
    longest = max(prompts) + max(request.output_tokens)
    require(
        longest <= UINT32_MAX,
        f"the longest prompt + the longest output ({longest}) exceeds any sequence length",
    )
    runs = request.warmup_runs + (request.timed_runs or DEFAULT_TIMED_RUNS)
    steps = runs * len(prompts) * sum(request.output_tokens)
    require(
        steps <= MAX_PROFILE_DECODE_STEPS,
        f"the job asks for {steps} decode steps ({runs} runs x {len(prompts)} prompts x "
        f"{sum(request.output_tokens)} output tokens); a job runs at most "
        f"{MAX_PROFILE_DECODE_STEPS}: split it, or ask for fewer runs or shorter outputs",
    )
    return JobSpec(
        input_tokens=prompts,
        output_tokens=tuple(request.output_tokens),
        warmup_runs=request.warmup_runs,
        timed_runs=request.timed_runs or DEFAULT_TIMED_RUNS,
        batch_size=request.config.batch_size or 1,
    )


def stream_timing(started: float, token_times: list[float], ended: float) -> StreamTiming:
    """Timings of a stream that started at ``started`` and received its tokens at
    ``token_times`` (seconds, one entry per token); TPOT is 0 with fewer than 2 tokens."""
    if not token_times:
        raise ValueError("the stream produced no tokens")
    first, last = token_times[0], token_times[-1]
    gaps = len(token_times) - 1
    return StreamTiming(
        ttft_ms=(first - started) * 1e3,
        tpot_ms=(last - first) * 1e3 / gaps if gaps else 0.0,
        latency_ms=(ended - started) * 1e3,
    )


@dataclass(frozen=True)
class LayerCounters:
    """A worker's layer clock as ``GetWorkerStats`` reports it (seconds, layer passes)."""

    prefill_seconds: float = 0.0
    prefill_passes: int = 0
    decode_seconds: float = 0.0
    decode_passes: int = 0

    @classmethod
    def of(cls, stats: worker_pb.GetWorkerStatsResponse) -> LayerCounters:
        return cls(
            stats.prefill_layer_seconds,
            stats.prefill_layer_passes,
            stats.decode_layer_seconds,
            stats.decode_layer_passes,
        )

    def layer_ms_since(self, before: LayerCounters, layers: int = 0) -> tuple[float, float]:
        """(prefill, decode) milliseconds of one layer between ``before`` and this reading
        of a stage of ``layers`` layers (0: unknown, taken as one prefill forward; a
        forward's clock counts :func:`clocked_layers` of them); 0 for a phase without
        passes.

        Decode: per layer pass. Prefill: what one layer adds to the run's TTFT, its last
        stream's first token (``summarise``), which comes after every prefill forward of
        the run: one forward's time x the ``n`` forwards. One forward for a batch
        prefilled together; one per sequence where they are prefilled one after another,
        as a batch of prompts longer than the engine's token budget is. Per forward
        alone, a batch of two read as costing batch 1's prefill (a probe: estimated 3.5 s
        for 6.9 s measured for the second of two 1,024-token prompts)."""

        def per_pass(seconds: float, passes: int) -> float:
            return seconds * 1e3 / passes if passes > 0 else 0.0

        prefill_passes = self.prefill_passes - before.prefill_passes
        timed = clocked_layers(layers) if layers > 0 else 0
        forwards = prefill_passes / timed if timed > 0 else 1.0
        prefill_ms = per_pass(self.prefill_seconds - before.prefill_seconds, prefill_passes)
        return (
            prefill_ms * max(1.0, forwards),
            per_pass(
                self.decode_seconds - before.decode_seconds,
                self.decode_passes - before.decode_passes,
            ),
        )


def summarise(
    output_tokens: int,
    runs: list[list[StreamTiming]],
    peaks: list[int],
    layer_ms: list[tuple[float, float]] | None = None,
) -> agent_pb.ProfiledRun:
    """Medians over timed ``runs`` (each the streams of one batch) at one output length;
    ``layer_ms`` holds each run's (prefill, decode) time per layer on rank 0.

    A batch's TTFT is its last stream's first token, as its latency is its last stream's
    end: a batch's prompts prefilled one after another give the last its first token
    after all of them, and a TTFT objective holds for a batch only if it holds for that
    one. (The mean of the streams' read half a prefill short at batch 2, and the latency
    the estimate builds from TTFT and TPOT a prefill short.) TPOT is the streams' mean."""
    if not runs or not all(runs):
        raise ValueError("every run needs at least one stream")
    ttft = [max(s.ttft_ms for s in run) for run in runs]
    tpot = [statistics.fmean(s.tpot_ms for s in run) for run in runs]
    latency = [max(s.latency_ms for s in run) for run in runs]
    layer_ms = layer_ms or []
    return agent_pb.ProfiledRun(
        output_tokens=output_tokens,
        ttft_ms=statistics.median(ttft),
        tpot_ms=statistics.median(tpot),
        latency_ms=statistics.median(latency),
        peak_memory_bytes_per_rank=peaks,
        ttft_layer_ms=statistics.median(p for p, _ in layer_ms) if layer_ms else 0.0,
        tpot_layer_ms=statistics.median(d for _, d in layer_ms) if layer_ms else 0.0,
    )


@dataclass(frozen=True)
class CpuReading:
    """Some cores' busy time and some processes' CPU time at one moment (ns)."""

    at_ns: int  # time.monotonic_ns()
    busy_ns: int  # the cores' time not idle, whoever ran
    own_ns: int  # the processes' threads' time on a CPU, on whichever cores


def cpu_reading(
    cores: Sequence[int], pids: Sequence[int], proc_root: Path = Path("/proc")
) -> CpuReading | None:
    """``cores``' busy time (``/proc/stat``: user, nice, system, irq, softirq, steal) and
    the CPU time of processes ``pids``' threads (their ``schedstat``); None without cores
    or where the kernel does not say (no such core, a process gone)."""
    if not cores:
        return None
    wanted = {f"cpu{c}" for c in cores}
    busy = 0
    try:
        lines = (proc_root / "stat").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            ticks = [int(x) for x in fields[1:9]]
            busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
            wanted.discard(fields[0])
    if wanted:
        return None
    own = 0
    for pid in pids:
        files = list((proc_root / str(pid) / "task").glob("*/schedstat"))
        if not files:
            return None
        for path in files:
            try:
                own += int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended meanwhile
    return CpuReading(time.monotonic_ns(), busy * _NS_PER_TICK, own)


def other_share(before: CpuReading | None, after: CpuReading | None, cores: int) -> float | None:
    """The share of ``cores`` cores' time between two readings that other processes
    used (their busy time less the stack's own processes'); None unknown."""
    if before is None or after is None or after.at_ns <= before.at_ns or cores < 1:
        return None
    others = (after.busy_ns - before.busy_ns) - (after.own_ns - before.own_ns)
    return max(0, others) / ((after.at_ns - before.at_ns) * cores)


def quiet_runs(shares: Sequence[float | None]) -> int:
    """How many runs of these shares of other processes count (not slowed)."""
    return sum(1 for r in shares if not slowed(r))


def enough_runs(shares: Sequence[float | None], wanted: int, again: bool) -> bool:
    """Whether the runs so far (their shares of other processes) are enough: ``wanted``
    quiet ones, or ``wanted`` in all when runs are not taken again (``again`` false),
    else RUNS_PER_TIMED_RUN times ``wanted``."""
    most = wanted * (RUNS_PER_TIMED_RUN if again else 1)
    return quiet_runs(shares) >= wanted or len(shares) >= most


def least_contended(shares: Sequence[float | None], wanted: int) -> list[int]:
    """Indices of the ``wanted`` runs other processes took least from (the first ones
    among equals), in the order they ran."""
    order = sorted(range(len(shares)), key=lambda i: (shares[i] or 0.0, i))
    return sorted(order[:wanted])


def prompt_token_ids(count: int, spec: ArchSpec) -> list[int]:
    """``count`` reproducible pseudo-random token ids of the model's vocabulary that are
    not its BOS or EOS tokens."""
    special = {spec.bos_token_id, *spec.eos_token_ids}
    pool = [t for t in range(min(spec.vocab_size, 32_000)) if t not in special]
    rng = random.Random(_PROMPT_SEED)
    return [rng.choice(pool) for _ in range(count)]


def peak_resident_bytes(pid: int, proc_root: Path = Path("/proc")) -> int:
    """The peak resident set of process ``pid`` (``VmHWM``), in bytes; 0 when unknown."""
    try:
        text = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            value, unit = line.split()[1:3]
            return int(value) * (1024 if unit.lower() == "kb" else 1)
    return 0


def reset_peak_resident(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Reset process ``pid``'s peak resident set (``VmHWM``) to its resident set now, as
    Linux allows since 4.0 (``5`` into ``/proc/<pid>/clear_refs``); False where it cannot
    (another kernel, no permission)."""
    try:
        (proc_root / str(pid) / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _nvml_process_bytes(cuda_index: int, pid: int) -> int:
    """Device memory NVML attributes to ``pid`` on GPU ``cuda_index`` (0 when none)."""
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == pid:
            return int(proc.usedGpuMemory or 0)
    return 0


class ProfilingJobs:
    """Runs profiling jobs with this node's supervisor; one instance per agent."""

    def __init__(
        self,
        supervisor: WorkerSupervisor,
        devices: dict[str, DeviceSpec],
        *,
        models_root: Path,
        ready_timeout_s: float,
    ):
        self.supervisor = supervisor
        self.devices = devices
        self.models_root = models_root
        self.ready_timeout_s = ready_timeout_s
        # Whether runs other processes slowed are taken again: not after a measurement
        # that got too few quiet runs even so, in this job or the ones after it (a
        # model's jobs follow each other, and the others' load lasts), until a
        # measurement's timed runs are all quiet.
        self._again = True

    async def run(self, request: agent_pb.RunProfilingJobRequest) -> list[agent_pb.ProfiledRun]:
        """Profile as the module docstring says; the workers never outlive the call.

        Errors: InvalidArgument or FailedPrecondition as StartWorkers gives them for the
        configuration and workers, FailedPrecondition / DeadlineExceeded when a worker
        fails to start (its log tail says why), RemoteError when a generation fails.
        """
        job = check_job(request)
        deployment_id = f"profile-{uuid.uuid4().hex[:12]}"
        start = agent_pb.StartWorkersRequest(
            request_id=request.request_id,
            deployment_id=deployment_id,
            checkpoint_path=request.checkpoint_path,
            config=request.config,
            workers=request.workers,
            max_seq_len=job.max_seq_len,
            # Whatever the node's ISERVE_ENGINE: the layer clock read here is the
            # PyTorch engine's.
            engine=agent_pb.ENGINE_KIND_PYTORCH,
        )
        plan = build_plan(
            start,
            devices=self.devices,
            models_root=self.models_root,
            default_ready_timeout_s=self.ready_timeout_s,
        )
        spec = parse_config(read_config(plan.checkpoint_dir))
        require(
            request.model_layers == 0 or request.model_layers >= spec.num_layers,
            f"model_layers ({request.model_layers}) is below the checkpoint's own "
            f"{spec.num_layers} layers: a fingerprint stands for a model at least its size",
        )
        plan = dataclasses.replace(
            plan,
            time_layers=True,
            records_expire_s=RECORDS_EXPIRE_S,
            # A fingerprint's: the checkpoint's own layers need nothing of the kind.
            footprint_model_layers=(
                request.model_layers if request.model_layers > spec.num_layers else 0
            ),
        )
        prompts = [prompt_token_ids(n, spec) for n in job.input_tokens]
        log.info("profiling job %s: %s", deployment_id, request.checkpoint_path)
        try:
            workers = await self.supervisor.start_workers(plan)
            # Rank 0's stage: the layers its clock counts a forward over.
            layers = next((w.layer_count for w in request.workers if w.rank == 0), 0)
            return await self._measure(job, prompts, workers, layers)
        finally:
            # Shielded: a cancelled call must still stop its workers.
            await asyncio.shield(self._stop(deployment_id))
            prune_job_logs(self.supervisor.log_dir)

    async def _stop(self, deployment_id: str) -> None:
        await self.supervisor.stop_workers(deployment_id)
        await self.supervisor.store.delete_workers(deployment_id)

    async def _measure(
        self,
        job: JobSpec,
        prompts: list[list[int]],
        workers: list[agent_pb.WorkerInfo],
        layers: int,
    ) -> list[agent_pb.ProfiledRun]:
        workers = sorted(workers, key=lambda w: w.rank)
        at_ready = {w.rank: self._process_baseline(w) for w in workers[1:]}
        # On CPU devices, what other processes take of their cores during each run: the
        # cores' busy time less the workers' and this agent's (it times the runs). A
        # GPU's speed is not its host cores'.
        on_cpu = not any(self.devices[w.device_id].is_cuda for w in workers)
        cores = (
            sorted({c for w in workers for c in self.devices[w.device_id].cpu_cores})
            if on_cpu
            else []
        )
        pids = sorted({os.getpid(), *(w.pid for w in workers)})
        async with channel(workers[0].address) as ch:
            stub = worker_service_pb2_grpc.WorkerServiceStub(ch)
            results = []
            for prompt, output_tokens in itertools.product(prompts, job.output_tokens):
                for _ in range(job.warmup_runs):
                    await self._batch(stub, prompt, output_tokens, job.batch_size)
                # Each timed run's layer time: the clock read after it, less the reading
                # before it (the previous run's). A run other processes slowed (on CPU
                # devices: they used much of the devices' cores meanwhile) is taken
                # again, up to RUNS_PER_TIMED_RUN times the timed runs; the runs they
                # took least from are kept.
                # Not after a measurement that got too few quiet runs even so (_again).
                stats = await self._worker_stats(stub)
                timed, layer_ms, shares = [], [], []
                while not enough_runs(shares, job.timed_runs, self._again):
                    before, cpu_before = LayerCounters.of(stats), cpu_reading(cores, pids)
                    timed.append(await self._batch(stub, prompt, output_tokens, job.batch_size))
                    shares.append(other_share(cpu_before, cpu_reading(cores, pids), len(cores)))
                    stats = await self._worker_stats(stub)
                    layer_ms.append(LayerCounters.of(stats).layer_ms_since(before, layers))
                kept = least_contended(shares, job.timed_runs)
                self._again = quiet_runs(shares) >= job.timed_runs
                if len(shares) > quiet_runs(shares):
                    log.info(
                        "profiling: other processes used the devices' cores in %d of %d runs "
                        "(shares %s); kept the %d they took least from",
                        len(shares) - quiet_runs(shares),
                        len(shares),
                        ", ".join(f"{r:.2f}" for r in shares if r is not None),
                        len(kept),
                    )
                peaks = self._peaks(stats, workers, at_ready)
                run = summarise(
                    output_tokens, [timed[i] for i in kept], peaks, [layer_ms[i] for i in kept]
                )
                run.input_tokens = len(prompt)
                measured = [shares[i] for i in kept]
                if all(r is not None for r in measured):
                    run.other_cpu_share = statistics.median(measured)
                results.append(run)
        return results

    @staticmethod
    async def _stream(
        stub: worker_service_pb2_grpc.WorkerServiceStub,
        prompt: list[int],
        output_tokens: int,
        started: float,
    ) -> StreamTiming:
        """One stream, its TTFT and latency timed from ``started`` (its batch's start)."""
        request = worker_pb.WorkerServiceGenerateRequest(
            request_id=f"profile-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=prompt,
            max_tokens=output_tokens,
            sampling=common.SamplingParams(temperature=0.0, ignore_eos=True),
        )
        token_times: list[float] = []
        try:
            async for message in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
                arrived = time.perf_counter()
                token_times.extend([arrived] * len(message.token_ids))
        except grpc.RpcError as exc:
            raise RemoteError(exc.code(), f"profiling generation failed: {exc.details()}") from exc
        ended = time.perf_counter()
        if len(token_times) != output_tokens:
            raise IServeError(
                f"the worker produced {len(token_times)} tokens, {output_tokens} requested"
            )
        return stream_timing(started, token_times, ended)

    def _process_baseline(self, worker: agent_pb.WorkerInfo) -> int:
        """A rank's figure (``_process_peak``) as its runs start. On CPU its peak
        resident set is first reset to what it holds now: the peak its load set (an int8
        layer's float weights before quantization) would otherwise hide any growth
        below it, and what is timed beside the layers (a fingerprint's copies, see
        monitor_agent.engine.footprint) would change what it hides."""
        device = self.devices[worker.device_id]
        if not device.is_cuda and not reset_peak_resident(worker.pid):
            log.debug("cannot reset the peak resident set of pid %d", worker.pid)
        return self._process_peak(worker)

    def _process_peak(self, worker: agent_pb.WorkerInfo) -> int:
        """The system's figure for a rank's process: device memory on CUDA, the peak
        resident set on CPU (bytes)."""
        device = self.devices[worker.device_id]
        if device.is_cuda and device.cuda_index is not None:
            return _nvml_process_bytes(device.cuda_index, worker.pid)
        return peak_resident_bytes(worker.pid)

    async def _batch(
        self,
        stub: worker_service_pb2_grpc.WorkerServiceStub,
        prompt: list[int],
        output_tokens: int,
        batch_size: int,
    ) -> list[StreamTiming]:
        """One run: ``batch_size`` streams opened at once, each timed from the batch's
        start. Timed from its own send, a stream sent a few ms after the first (under
        load) read a TTFT shorter than the prefills of the batch it waited for, below
        what rank 0's layer clock counted (a CI run with a busy core)."""
        started = time.perf_counter()
        streams = await asyncio.gather(
            *(self._stream(stub, prompt, output_tokens, started) for _ in range(batch_size))
        )
        return list(streams)

    @staticmethod
    async def _worker_stats(
        stub: worker_service_pb2_grpc.WorkerServiceStub,
    ) -> worker_pb.GetWorkerStatsResponse:
        try:
            return await stub.GetWorkerStats(
                worker_pb.GetWorkerStatsRequest(), timeout=STATS_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            raise RemoteError(exc.code(), f"reading worker stats failed: {exc.details()}") from exc

    def _peaks(
        self,
        stats: worker_pb.GetWorkerStatsResponse,
        workers: list[agent_pb.WorkerInfo],
        at_ready: dict[int, int],
    ) -> list[int]:
        """Peak memory of each rank, rank 0's from ``stats`` read after the runs (see the
        module docstring)."""
        peaks = [int(stats.peak_memory_bytes)]
        for worker in workers[1:]:
            record = self.supervisor.worker_record(worker.deployment_id, worker.rank) or {}
            own = record.get("peak_memory_bytes")
            if isinstance(own, int) and own > 0:
                peaks.append(own)
                continue
            growth = max(0, self._process_peak(worker) - at_ready[worker.rank])
            peaks.append(int(worker.resident_bytes) + growth)
        return peaks
