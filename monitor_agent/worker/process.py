"""The worker process: pin cores, load the engine, serve WorkerService, report readiness.

Readiness protocol: once the server listens, the worker writes
``{"port": P, "pid": PID, "resident_bytes": N}`` (N: bytes of weights and KV cache) to
``--ready-file`` atomically (a temporary file renamed into place), so the agent never
reads a half-written file. A
worker that cannot start exits non-zero with the reason as the last lines of its log:
2 for bad arguments, 1 when the engine cannot load (or its parallel group cannot form).
SIGTERM drains it: health turns NOT_SERVING, new generations get UNAVAILABLE, those in
flight get up to ``--drain-timeout-s`` seconds to finish (the agent passes
``ISERVE_DRAIN_TIMEOUT_S`` and waits that long plus a margin before SIGKILL), then it
exits with code 0.

Tensor/pipeline parallelism (``--world-size`` = tp·pp > 1): every rank is one process,
started with its ``--rank``, its stage's ``--first-layer``/``--layer-count`` and the
``--rendezvous`` address where rank 0 hosts the torch.distributed store. Each joins the
group, loads its stage's shard and checks the stages' layer map with the others (which
also waits until every rank has loaded); only then does any rank write its ready file.
Rank 0 serves WorkerService and drives the steps; the other ranks serve nothing and run
the steps rank 0 broadcasts (:mod:`monitor_agent.worker.follower`), writing
``"port": 0`` in their ready files and, as their steps run, their peak memory
(``"peak_memory_bytes"``, which rank 0 reports through GetWorkerStats instead). When
the group loses a rank, rank 0 fails the requests in flight with UNAVAILABLE and exits
with code 3, the others exit with code 3 as well (see
:mod:`monitor_agent.engine.distributed`).

Engines (``--engine``, default ``ISERVE_ENGINE``, see
:mod:`monitor_agent.engine.trtllm.selection`): the PyTorch engine, or TensorRT-LLM on
NVIDIA GPUs, which runs a whole tp·pp group from rank 0's process (``--group-devices``,
``--stage-layers``) and accepts the quantizations only it has (GPTQ/AWQ int4, an fp8 KV
cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from monitor_agent.engine.trtllm import mapping as trtllm_mapping
from monitor_agent.worker.exits import EXIT_BAD_ARGUMENTS, EXIT_ENGINE_FAILED, EXIT_GROUP_LOST
from services.engine_rules import TENSOR_PARALLEL_DEGREES
from services.grpc_server import ServiceBinding, configure_logging, run_server
from services.models.compression import (
    DEFAULT_PRUNE_FRACTION,
    KV_QUANTIZATIONS,
    PRUNINGS,
    WEIGHT_QUANTIZATIONS,
)
from services.security import server_security
from services.settings import (
    ENGINE_CHOICES,
    drain_timeout_s,
    engine_choice,
    load_settings,
    log_level,
)

if TYPE_CHECKING:
    from monitor_agent.engine.distributed import ParallelContext
    from monitor_agent.engine.engine import Engine
    from monitor_agent.engine.trtllm.engine import TrtLlmEngine
    from monitor_agent.engine.trtllm.mapping import TrtLlmConfig

log = logging.getLogger("iserve.worker")

PARENT_POLL_S = 1.0
# After the group lost a rank, generations in flight get this long to send their error.
LOST_GROUP_DRAIN_S = 1.0
PYTORCH_ENGINE = "pytorch"
TENSORRT_LLM_ENGINE = "tensorrt_llm"
# How long the worker waits, once its server stopped, for gRPC to end the calls it cut.
CUT_CALLS_WAIT_S = 1.0
# Options only the TensorRT-LLM engine runs.
TRTLLM_ONLY_WEIGHT_QUANTIZATIONS = tuple(
    q for q in trtllm_mapping.WEIGHT_QUANTIZATIONS if q not in WEIGHT_QUANTIZATIONS
)
TRTLLM_ONLY_KV_QUANTIZATIONS = tuple(
    q for q in trtllm_mapping.KV_CACHE_DTYPES if q not in KV_QUANTIZATIONS
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m monitor_agent.worker", description="Run one iserve engine worker."
    )
    parser.add_argument("--deployment-id", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1, help="tp·pp ranks in all")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--pipeline-parallel", type=int, default=1)
    parser.add_argument("--first-layer", type=int, default=0, help="first layer of this stage")
    parser.add_argument(
        "--layer-count", type=int, default=0, help="layers of this stage (0: to the last layer)"
    )
    parser.add_argument(
        "--rendezvous", default="", help="HOST:PORT of the torch.distributed store (rank 0's)"
    )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=300.0,
        help="a rank that waits this long for a peer in a collective gives the group up",
    )
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument(
        "--kv-quant",
        default="none",
        choices=[*KV_QUANTIZATIONS, *TRTLLM_ONLY_KV_QUANTIZATIONS],
        help="KV-cache storage: the model dtype, or int8 with per-position scales; fp8 "
        "with the TensorRT-LLM engine only",
    )
    parser.add_argument(
        "--weight-quant",
        default="none",
        choices=[*WEIGHT_QUANTIZATIONS, *TRTLLM_ONLY_WEIGHT_QUANTIZATIONS],
        help="weight-only quantization of the attention and MLP projections; the GPTQ/AWQ "
        "int4 checkpoints with the TensorRT-LLM engine only",
    )
    parser.add_argument(
        "--pruning",
        default="none",
        choices=PRUNINGS,
        help="2:4 magnitude pruning (dense, or compact values + indices), or structured "
        "pruning of heads and MLP channels",
    )
    parser.add_argument(
        "--prune-fraction",
        type=float,
        default=DEFAULT_PRUNE_FRACTION,
        help="share of heads and MLP channels --pruning structured drops, in [0, 1)",
    )
    parser.add_argument(
        "--time-layers",
        action="store_true",
        help="keep a layer clock (GetWorkerStats reports it); profiling jobs set this",
    )
    parser.add_argument(
        "--footprint-layers",
        type=int,
        default=0,
        help="with --time-layers: the layers the full model's stage holds where this "
        "checkpoint is its fingerprint; on a CPU the clock then times this stage's layers "
        "with that stage's cache footprint (0: as they are)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda:N")
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default=None,
        help="the engine to run (default: ISERVE_ENGINE, else auto)",
    )
    parser.add_argument(
        "--group-devices",
        default="",
        help="TensorRT-LLM engine: comma-separated CUDA device indices of every rank of the "
        "group, in rank order (default: --device's, for one rank)",
    )
    parser.add_argument(
        "--stage-layers",
        default="",
        help="TensorRT-LLM engine: each pipeline stage's layer count, comma-separated "
        "(default: an even split)",
    )
    parser.add_argument(
        "--cores", default="", help="comma-separated CPU cores to pin to (empty: no pinning)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", required=True, type=Path)
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=0,
        help="stop once this process (the agent that started the worker) is no longer its parent",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="seconds generations in flight get to finish after SIGTERM "
        "(default: the drain timeout of services.settings)",
    )
    parser.add_argument("--log-level", default=log_level())
    return parser.parse_args(argv)


def parse_cores(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``; ValueError names the bad entry."""
    cores = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit():
            raise ValueError(f"--cores: {part!r} is not a core number")
        cores.append(int(part))
    return cores


def check_args(args: argparse.Namespace) -> list[int]:
    """The cores to pin to; ValueError with a user-facing message for unsupported args."""
    tp, pp = args.tensor_parallel, args.pipeline_parallel
    if tp not in TENSOR_PARALLEL_DEGREES:
        raise ValueError(f"--tensor-parallel must be one of {TENSOR_PARALLEL_DEGREES}, got {tp}")
    if pp < 1:
        raise ValueError(f"--pipeline-parallel must be at least 1, got {pp}")
    if args.world_size != tp * pp:
        raise ValueError(f"--world-size {args.world_size} must equal tp·pp = {tp * pp}")
    if not 0 <= args.rank < args.world_size:
        raise ValueError(f"--rank {args.rank} is outside 0..{args.world_size - 1}")
    check_engine(args)
    if args.world_size > 1 and args.engine == PYTORCH_ENGINE and not args.rendezvous:
        raise ValueError("--rendezvous HOST:PORT is required with more than one rank")
    if args.first_layer < 0 or args.layer_count < 0:
        raise ValueError("--first-layer and --layer-count must not be negative")
    if pp == 1 and (args.first_layer or args.layer_count):
        raise ValueError("--first-layer and --layer-count select a pipeline stage; pp is 1")
    if args.collective_timeout_s <= 0:
        raise ValueError("--collective-timeout-s must be positive")
    if args.max_seq_len < 1 or args.max_batch < 1:
        raise ValueError("--max-seq-len and --max-batch must be at least 1")
    if not 0 <= args.prune_fraction < 1:
        raise ValueError(f"--prune-fraction must be in [0, 1), got {args.prune_fraction}")
    if args.drain_timeout_s is None:
        args.drain_timeout_s = drain_timeout_s()
    if args.drain_timeout_s <= 0:
        raise ValueError(f"--drain-timeout-s must be positive, got {args.drain_timeout_s:g}")
    return parse_cores(args.cores)


def check_engine(args: argparse.Namespace) -> None:
    """Set ``args.engine`` to the engine this worker runs ("pytorch" or "tensorrt_llm");
    ValueError (CannotMap, EngineUnavailable) saying why when the choice cannot run."""
    from monitor_agent.engine.trtllm.selection import choose_engine

    choice = args.engine or engine_choice()
    if args.time_layers:
        # Profiling times layers, which only the PyTorch engine's layer clock does.
        if choice == TENSORRT_LLM_ENGINE:
            raise ValueError("--time-layers needs the PyTorch engine's layer clock")
        choice = PYTORCH_ENGINE
    # auto may run TensorRT-LLM only where the agent started this process as the group.
    args.engine = choose_engine(
        choice, trtllm_config(args), device=args.device, worker_ranks=args.world_size
    )
    if args.engine == TENSORRT_LLM_ENGINE:
        if args.rank != 0:
            raise ValueError(
                f"--rank {args.rank}: the TensorRT-LLM engine runs every rank of the group "
                "from rank 0's worker; start rank 0 only"
            )
        return
    only = {
        "--weight-quant": (args.weight_quant, TRTLLM_ONLY_WEIGHT_QUANTIZATIONS),
        "--kv-quant": (args.kv_quant, TRTLLM_ONLY_KV_QUANTIZATIONS),
    }
    for option, (value, trtllm_only) in only.items():
        if value in trtllm_only:
            raise ValueError(f"{option} {value} needs the TensorRT-LLM engine (--engine)")
    for option, value in (
        ("--group-devices", args.group_devices),
        ("--stage-layers", args.stage_layers),
    ):
        if value:
            raise ValueError(
                f"{option} is for the TensorRT-LLM engine; the PyTorch engine "
                "takes one rank's --device and --first-layer/--layer-count"
            )


def trtllm_config(args: argparse.Namespace) -> TrtLlmConfig:
    """The TensorRT-LLM engine's configuration in ``args``; ValueError for a malformed
    --group-devices or --stage-layers."""
    from monitor_agent.engine.trtllm.mapping import TrtLlmConfig

    if args.group_devices:
        devices = tuple(_int_list(args.group_devices, "--group-devices"))
    else:
        _, _, index = args.device.partition(":")
        devices = (int(index) if index.isdigit() else 0,)
    return TrtLlmConfig(
        checkpoint_dir=args.checkpoint,
        devices=devices,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        max_batch=args.max_batch,
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        stage_layers=tuple(_int_list(args.stage_layers, "--stage-layers")),
        weight_quant=args.weight_quant,
        kv_cache_dtype=None if args.kv_quant == "none" else args.kv_quant,
        pruning=args.pruning,
    )


def _int_list(text: str, option: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"{option}: give comma-separated non-negative integers, got {text!r}")
    return [int(p) for p in parts]


def write_ready_file(path: Path, record: dict) -> None:
    """Write ``record`` as JSON so that readers see the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def peak_memory_probe(
    engine: Engine | TrtLlmEngine, device: str, engine_kind: str = PYTORCH_ENGINE
) -> Callable[[], int]:
    """A function returning the worker's peak memory in bytes on ``device``: the CUDA
    allocator's peak on GPUs; on CPU, where the process RSS mostly measures the Python
    runtime, the engine's own account of weights, KV cache and peak activations. The
    TensorRT-LLM engine allocates outside torch's allocator (and in its own rank
    processes), so its own account is its peak: what its build took on the devices."""
    if device.startswith("cuda") and engine_kind == PYTORCH_ENGINE:
        import torch

        return lambda: int(torch.cuda.max_memory_allocated(torch.device(device)))
    return lambda: engine.memory.resident_bytes


def parent_watch(
    parent_pid: int, on_orphaned: Callable[[], None] = lambda: None
) -> Callable[[], Awaitable[None]]:
    """A background task that stops this worker (as SIGTERM would) once ``parent_pid`` is
    no longer its parent, telling ``on_orphaned`` first.

    Workers run in their own session so the agent can signal them as a group; that also
    means nothing stops them if the agent dies without cleaning up, hence this watch.
    """

    async def watch_parent() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(PARENT_POLL_S)
        log.warning("parent process %d exited; stopping", parent_pid)
        on_orphaned()
        os.kill(os.getpid(), signal.SIGTERM)

    return watch_parent


def drain_budget(
    timeout_s: float, *, group_lost: bool, orphaned: bool, heartbeat_ttl_s: float
) -> float:
    """Seconds a stopping worker lets its streams in flight finish: a group that lost a
    rank finishes nothing (LOST_GROUP_DRAIN_S); a worker whose agent died has until the
    deployer, once the agent's heartbeat lapses, releases its memory for other workers
    (a tester: such workers drained 25 s on memory already given away); else
    ``timeout_s``."""
    if group_lost:
        return LOST_GROUP_DRAIN_S
    if orphaned:
        return min(timeout_s, heartbeat_ttl_s)
    return timeout_s


async def wait_for_cut_calls(timeout_s: float = CUT_CALLS_WAIT_S) -> None:
    """Wait up to ``timeout_s`` seconds for the loop's other tasks to end.

    Stopping the server cuts the calls still open (the scheduler's Session stays open for
    as long as the worker lives), and gRPC's task for each call takes a few loop steps
    more to end. One that the closing event loop cancels instead is logged as an ERROR
    traceback ("Exception not handled by _handle_exceptions ... CancelledError") although
    nothing failed.
    """
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=timeout_s)


async def serve(args: argparse.Namespace, engine: Engine | TrtLlmEngine) -> bool:
    """Serve WorkerService until SIGTERM; True when it stopped because the parallel group
    lost a rank."""
    # Imported here, not at the top: they import torch, which must start its thread pools
    # only after main() has pinned the process to its cores.
    from monitor_agent.engine.distributed import DistributedModel
    from monitor_agent.worker.runner import EngineRunner
    from monitor_agent.worker.servicer import WorkerIdentity, WorkerServicer
    from services.api import worker_service_pb2_grpc

    runner = EngineRunner(engine)
    resident_bytes = engine.memory.resident_bytes
    servicer = WorkerServicer(
        runner,
        WorkerIdentity(args.deployment_id, args.rank),
        peak_memory_bytes=peak_memory_probe(engine, args.device, args.engine),
    )
    binding = ServiceBinding(
        servicer,
        worker_service_pb2_grpc.add_WorkerServiceServicer_to_server,
        "iserve.v1.WorkerService",
    )

    def announce(port: int) -> None:
        write_ready_file(
            args.ready_file, {"port": port, "pid": os.getpid(), "resident_bytes": resident_bytes}
        )
        log.info("worker %s rank %d ready on port %d", args.deployment_id, args.rank, port)

    group = engine.model if isinstance(engine.model, DistributedModel) else None
    if group is not None:
        # A lost group stops this worker as SIGTERM would (streams in flight get their
        # error at the engine's next step); main() then exits with EXIT_GROUP_LOST.
        group.on_lost = lambda _reason: os.kill(os.getpid(), signal.SIGTERM)
        group.start_keepalive()

    # The agent's environment: its TLS files and the service token, the only token a
    # worker accepts (it holds no connection to the registry in Redis).
    settings = load_settings()
    security = await server_security(settings, None)
    orphaned = asyncio.Event()  # the agent that started this worker is gone

    async def drain(timeout_s: float) -> bool:
        # A group that lost a rank finishes nothing: its generations only need the moment
        # it takes to send their UNAVAILABLE.
        lost = group is not None and group.lost is not None
        budget = drain_budget(
            timeout_s,
            group_lost=lost,
            orphaned=orphaned.is_set(),
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
        )
        return await servicer.in_flight.drain(budget)

    try:
        await run_server(
            f"worker-{args.deployment_id}-r{args.rank}",
            [binding],
            f"{args.host}:{args.port}",
            on_started=announce,
            background=([parent_watch(args.parent_pid, orphaned.set)] if args.parent_pid else []),
            drain=drain,
            drain_timeout_s=args.drain_timeout_s,
            security=security,
        )
        await wait_for_cut_calls()
    finally:
        runner.close()
        if group is not None:
            await asyncio.to_thread(group.close)
        if args.engine == TENSORRT_LLM_ENGINE:
            await asyncio.to_thread(engine.close)
    return group is not None and group.lost is not None


def join_group(args: argparse.Namespace) -> ParallelContext | None:
    """This rank's place in the tensor/pipeline-parallel group; None for a single rank or
    the TensorRT-LLM engine (which forms its group itself)."""
    if args.world_size == 1 or args.engine == TENSORRT_LLM_ENGINE:
        return None
    from monitor_agent.engine.distributed import ParallelLayout, init_parallel

    return init_parallel(
        ParallelLayout(args.tensor_parallel, args.pipeline_parallel, args.rank),
        rendezvous=args.rendezvous,
        device=args.device,
        first_layer=args.first_layer,
        layer_count=args.layer_count or None,
        timeout_s=args.collective_timeout_s,
        bind_host=args.host,
    )


def load_engine(
    args: argparse.Namespace, cores: list[int], parallel: ParallelContext | None = None
) -> Engine | TrtLlmEngine:
    """The engine ``args`` describe, computing on ``len(cores)`` threads (all if none);
    with ``parallel``, this rank's stage and shard of it."""
    if getattr(args, "engine", None) == TENSORRT_LLM_ENGINE:
        from monitor_agent.engine.trtllm.engine import TrtLlmEngine

        return TrtLlmEngine(trtllm_config(args))
    from monitor_agent.engine.engine import Engine

    return Engine(
        args.checkpoint,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        max_batch=args.max_batch,
        device=args.device,
        num_threads=len(cores) or None,
        kv_cache_dtype=None if args.kv_quant == "none" else args.kv_quant,
        parallel=parallel,
        weight_quant=args.weight_quant,
        pruning=args.pruning,
        prune_fraction=args.prune_fraction,
        time_layers=args.time_layers,
        footprint_layers=args.footprint_layers,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level.upper(), f"worker[{args.deployment_id}/r{args.rank}]")
    try:
        cores = check_args(args)
        if cores:
            # Before torch starts its thread pools, so they inherit the mask.
            os.sched_setaffinity(0, cores)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_ARGUMENTS

    try:
        parallel = join_group(args)
    except Exception as exc:  # noqa: BLE001 - the agent shows this line as the reason
        log.debug("joining the group failed", exc_info=True)
        print(
            f"error: rank {args.rank} cannot join the parallel group at {args.rendezvous}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_ENGINE_FAILED
    try:
        engine = load_engine(args, cores, parallel)
        if parallel is not None:
            from monitor_agent.engine.distributed import check_layer_map

            # A collective: it also waits until every rank has loaded its stage.
            check_layer_map(engine.model.stage, parallel.layout)
    except Exception as exc:  # noqa: BLE001 - the agent shows this line as the reason
        log.debug("engine failed to load", exc_info=True)
        print(f"error: cannot load {str(args.checkpoint)!r}: {exc}", file=sys.stderr, flush=True)
        return EXIT_ENGINE_FAILED
    if args.rank != 0:
        from monitor_agent.worker.follower import FollowerPeak, run_follower

        record = {"port": 0, "pid": os.getpid(), "resident_bytes": engine.memory.resident_bytes}
        record_lock = threading.Lock()

        def publish(**fields: int) -> None:
            with record_lock:
                record.update(fields)
                write_ready_file(args.ready_file, record)

        def announce() -> None:
            publish()
            log.info("worker %s rank %d ready", args.deployment_id, args.rank)

        peak = FollowerPeak(
            engine.batch,
            peak_memory_probe(engine, args.device, args.engine),
            lambda n: publish(peak_memory_bytes=n),
        )
        stopped = run_follower(
            engine.model,
            parent_pid=args.parent_pid,
            announce=announce,
            around_stage=peak.around_stage,
        )
        return 0 if stopped else EXIT_GROUP_LOST
    lost = asyncio.run(serve(args, engine))
    return EXIT_GROUP_LOST if lost else 0
