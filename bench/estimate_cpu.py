"""Estimation accuracy on this machine's CPU: profiled fingerprints against full-model runs.

Method: start the real stack (embedded redis-server, every service, one node agent with
2 virtual CPU devices, each pinned to one core) in a temporary state directory on free
ports. Create three 24-layer checkpoints, Llama-, Falcon- and GPT-J-style, narrow (hidden
512 by default) so that runs are fast, and register each with an int8-weight variant and profiling:
the real profiler cuts fingerprints (1-2 layers at pp = 1, 2-3 at pp = 2) and runs them
through the agent at (1,1), (1,2), (2,1), batch 1 and 2, 64-token prompt, outputs 8
and 16. Every full model (each variant) is measured, once before the profiling and
once after (``--passes``: the two passes bracket the fingerprints' measurements, so
their disagreement, the floor, spans the machine's drift over that time), at every
(tp, pp) that 2 devices allow, (1,1), (2,1), (1,2) ((2,2) needs 4 devices: skipped), by the same path
the profiler uses: ``AgentService.RunProfilingJob`` with the full checkpoint, batch 1,
the profiler's prompt and output lengths and timed runs. It reports TTFT and TPOT from
stream timestamps, end-to-end latency, and each rank's peak memory (the workers' own
accounting of weights + KV cache + activation peak); memory here is that figure summed
over the ranks, as the estimator's total is.

Estimates come from ``EstimatorService.EstimateConfigs`` (hardware ``cpu-x86_64``,
workload batch 1, 64-token prompt, 16 output tokens, 2 devices), compared with the
measured full-model run at 16 output tokens. Three estimator states:

  shipped      the calibration committed in estimator_svc/calibrations (fitted
               by an earlier run of this bench, so in part on the same models);
  LOAO         leave one architecture out: the full-model rows of the other two
               architectures are stored as ``full_model`` measurements, ``Calibrate``
               fits on them, and the held-out architecture (whose own full-model rows are
               not stored at that moment) is estimated;
  all          calibrated on all three (in-sample, for reference only).

The calibration fitted on all three is written to
``estimator_svc/calibrations/cpu-x86_64.json`` with ``--write-calibration`` when the
fit is sane (finite constants, reference scales within 0.5-2, fit error below 15 %).

On a machine with NVIDIA GPUs the agent finds them through NVML instead of making
virtual CPU devices, and the same method runs on CUDA (the hardware type, the device
count and the layouts they allow come from the node the agent registered). For one GPU:
``--devices 1 --dtype bfloat16 --hidden 2048`` measures (1,1) only, batch 1 and 2
fingerprints, every model in bfloat16 as served (the checkpoint's dtype on CUDA).

Run: .venv/bin/python bench/estimate_cpu.py [--save raw.json] [--load raw.json]
     [--devices N] [--dtype float32|bfloat16|float16] [--write-calibration]
``--load`` skips profiling and measuring: it puts the saved models and measurements
into a fresh stack's Redis and redoes the estimates (for iterating on the estimator).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from google.protobuf import json_format

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator_svc.calibration_message import SHIPPED_DIR  # noqa: E402
from fingerprint_svc.profile_plan import ProfileJob, VariantTarget  # noqa: E402
from services.api import agent_service_pb2 as agent_pb  # noqa: E402
from services.api import (  # noqa: E402
    agent_service_pb2_grpc,
    deployment_service_pb2_grpc,
    estimator_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import common_pb2 as common  # noqa: E402
from services.api import deployment_service_pb2 as deploy_pb  # noqa: E402
from services.api import estimator_service_pb2 as est_pb  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.cli import stack as launcher  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from services.state.store import StateStore  # noqa: E402

# The node's hardware type, e.g. "cpu-x86_64" or "nvidia-h100-80gb-hbm3": set by main from
# the node the agent registered.
HARDWARE = ""
LAYERS = 24
INPUT_TOKENS = 64
OUTPUT_TOKENS = (8, 16)
EVAL_OUTPUT = 16
ALL_LAYOUTS = ((1, 1), (2, 1), (1, 2))
# The layouts the node's devices allow (main narrows it to one GPU's (1,1)).
LAYOUTS = ALL_LAYOUTS
ARCHS = {
    # model id: create_checkpoint arguments
    "cpu-llama": dict(arch="llama", num_heads=8, num_kv_heads=4),
    "cpu-falcon": dict(arch="falcon", num_heads=8, num_kv_heads=1),
    "cpu-gptj": dict(arch="gptj", num_heads=8),
}
VARIANTS = (
    VariantTarget("base", ""),
    VariantTarget("int8", "", common.WEIGHT_QUANT_INT8, common.KV_QUANT_NONE, common.PRUNING_NONE),
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_async(coro):
    return asyncio.run(coro)


async def _with_store(settings, fn):
    store = StateStore.from_url(settings.redis_url)
    try:
        return await fn(store)
    finally:
        await store.close()


# ---- the node ------------------------------------------------------------------------------
def describe_node(deploy_stub) -> dict:
    """The live node's devices as the agent registered them (GPUs through NVML, else the
    virtual CPU devices)."""
    cluster = deploy_stub.GetClusterState(deploy_pb.GetClusterStateRequest())
    node = next(n for n in cluster.nodes if n.alive)
    kinds = {common.DEVICE_KIND_CUDA: "cuda", common.DEVICE_KIND_CPU_VIRTUAL: "cpu"}
    return {
        "hardware_type": node.devices[0].hardware_type,
        "kind": kinds.get(node.devices[0].kind, "other"),
        "name": node.devices[0].name,
        "count": len(node.devices),
        "total_bytes": node.devices[0].total_bytes,
    }


def use_node(node: dict, devices: int) -> None:
    """Measure and estimate on ``node``'s hardware, at the layouts that
    min(its devices, ``devices``) allow."""
    global HARDWARE, LAYOUTS
    HARDWARE = node["hardware_type"]
    usable = min(node["count"], devices)
    LAYOUTS = tuple((tp, pp) for tp, pp in ALL_LAYOUTS if tp * pp <= usable)


def use_layers(layers: int) -> None:
    """Write, measure and describe models of ``layers`` decoder layers."""
    global LAYERS
    LAYERS = layers


def layouts_text() -> str:
    return ", ".join(f"({tp},{pp})" for tp, pp in LAYOUTS)


# ---- profiling and measuring -------------------------------------------------------------
def write_checkpoints(settings, hidden: int, dtype: str) -> None:
    for model_id, shape in ARCHS.items():
        shape["hidden_size"] = hidden
        log(f"writing {model_id} ({shape['arch']}, {LAYERS} layers, hidden {hidden}, {dtype}) ...")
        create_checkpoint(settings.models_root / model_id, num_layers=LAYERS, dtype=dtype, **shape)


def register_and_profile(settings, models_stub) -> dict[str, model_pb.Model]:
    for model_id, shape in ARCHS.items():
        models_stub.RegisterModel(
            model_pb.RegisterModelRequest(
                model_id=model_id,
                checkpoint_path=model_id,
                variants=[
                    common.CompressionVariant(
                        name=v.name,
                        weight_quant=v.weight_quant,
                        kv_quant=v.kv_quant,
                        pruning=v.pruning,
                    )
                    for v in VARIANTS
                    if v.name != "base"
                ],
            )
        )
        log(f"registered {model_id} ({shape['arch']}, {LAYERS} layers) with profiling")
    for model_id in ARCHS:
        last = None
        for event in models_stub.WatchModel(
            model_pb.WatchModelRequest(model_id=model_id), timeout=1800
        ):
            if last is None or event.runs_done != last.runs_done:
                log(f"  {model_id}: {event.runs_done}/{event.runs_total} {event.current}")
            last = event
        if last.state != model_pb.MODEL_STATE_PROFILED:
            raise RuntimeError(f"{model_id} ended {last.state}: {last.message}")
    out = {}
    for model_id in ARCHS:
        out[model_id] = models_stub.GetModel(model_pb.GetModelRequest(model_id=model_id)).model
        profile = models_stub.GetProfile(model_pb.GetProfileRequest(model_id=model_id))
        log(
            f"{model_id}: {len(profile.measurements)} measurements, skipped "
            f"{list(profile.skipped)}, {profile.cost.device_seconds:.0f} device-s, "
            f"{profile.cost.wall_time_ms / 1e3:.0f} s wall"
        )
    return out


def measure_full_models(
    settings, deploy_stub, timed_runs: int, pass_index: int = 0
) -> list[model_pb.ProfileMeasurement]:
    cluster = deploy_stub.GetClusterState(deploy_pb.GetClusterStateRequest())
    node = next(n for n in cluster.nodes if n.alive)
    device_ids = sorted((d.ref.device_id for d in node.devices), key=lambda s: (len(s), s))
    hardware = node.devices[0].hardware_type
    agent = agent_service_pb2_grpc.AgentServiceStub(grpc.insecure_channel(node.agent_address))
    points = [(m, v, lay) for m in ARCHS for v in VARIANTS for lay in LAYOUTS]
    # Rotate the layout order per (model, variant) so no layout always runs first.
    ordered = []
    for i in range(0, len(points), len(LAYOUTS)):
        group = points[i : i + len(LAYOUTS)]
        k = (i // len(LAYOUTS) + pass_index) % len(LAYOUTS)
        ordered += group[k:] + group[:k]
    rows = []
    for n, (model_id, variant, (tp, pp)) in enumerate(ordered, 1):
        job = ProfileJob(variant, tp, pp, LAYERS, 1)
        request = agent_pb.RunProfilingJobRequest(
            request_id=f"bench-{model_id}-{variant.name}-{tp}x{pp}",
            checkpoint_path=model_id,
            config=job.config(),
            workers=job.worker_specs(device_ids[: tp * pp]),
            input_tokens=INPUT_TOKENS,
            output_tokens=OUTPUT_TOKENS,
            warmup_runs=1,
            timed_runs=timed_runs,
        )
        started = time.perf_counter()
        reply = agent.RunProfilingJob(request, timeout=900)
        for run in reply.runs:
            rows.append(
                model_pb.ProfileMeasurement(
                    variant_name=variant.name,
                    num_layers=LAYERS,
                    full_model=True,
                    config=job.config(),
                    stage_layers=job.stage_layers,
                    input_tokens=INPUT_TOKENS,
                    output_tokens=run.output_tokens,
                    ttft_ms=run.ttft_ms,
                    tpot_ms=run.tpot_ms,
                    latency_ms=run.latency_ms,
                    peak_memory_bytes_per_rank=run.peak_memory_bytes_per_rank,
                    ttft_layer_ms=run.ttft_layer_ms,
                    tpot_layer_ms=run.tpot_layer_ms,
                    repetitions=timed_runs,
                    hardware_type=hardware,
                )
            )
        log(
            f"full model {n}/{len(ordered)} (pass {pass_index + 1}): {model_id} {variant.name} "
            f"tp={tp} pp={pp} "
            f"({time.perf_counter() - started:.1f} s)"
        )
    return rows


def rows_per_model() -> int:
    return len(VARIANTS) * len(LAYOUTS) * len(OUTPUT_TOKENS)


def _points(rows) -> dict[tuple, model_pb.ProfileMeasurement]:
    """A pass's rows by (model index, variant, tp, pp, output tokens). Rows carry no model
    id; every pass lists the models in ARCHS order, rows_per_model() rows each."""
    return {
        (
            i // rows_per_model(),
            r.variant_name,
            r.config.tensor_parallel,
            r.config.pipeline_parallel,
            r.output_tokens,
        ): r
        for i, r in enumerate(rows)
    }


def combine_passes(passes) -> list[model_pb.ProfileMeasurement]:
    """One row per point, in the first pass's order: the median over the passes of every
    timing, and of each rank's peak memory."""
    indexed = [_points(rows) for rows in passes]
    combined = []
    for point, first in indexed[0].items():
        same = [p[point] for p in indexed]
        row = model_pb.ProfileMeasurement()
        row.CopyFrom(first)
        for field in ("ttft_ms", "tpot_ms", "latency_ms", "ttft_layer_ms", "tpot_layer_ms"):
            setattr(row, field, statistics.median(getattr(r, field) for r in same))
        del row.peak_memory_bytes_per_rank[:]
        row.peak_memory_bytes_per_rank.extend(
            int(statistics.median(ranks))
            for ranks in zip(*(r.peak_memory_bytes_per_rank for r in same), strict=True)
        )
        combined.append(row)
    return combined


def repeatability(passes) -> dict[str, tuple[float, float]]:
    """How far the same full-model job, measured in two passes minutes apart (the first
    before the fingerprints were profiled, the second after), disagrees with itself, per
    metric (median, p90 of |pass 2 / pass 1 - 1| %): the floor under any estimate's
    error against one measurement. Empty with one pass."""
    if len(passes) < 2:
        return {}
    a, b = _points(passes[0]), _points(passes[1])
    metrics = {
        "latency": lambda r: r.latency_ms,
        "TTFT": lambda r: r.ttft_ms,
        "TPOT": lambda r: r.tpot_ms,
        "memory": lambda r: sum(r.peak_memory_bytes_per_rank),
    }
    floors = {}
    for name, value in metrics.items():
        ape = [100.0 * abs(value(b[k]) / value(a[k]) - 1.0) for k in a if k[-1] == EVAL_OUTPUT]
        floors[name] = (float(np.median(ape)), float(np.percentile(ape, 90)))
    return floors


def print_repeatability(floors: dict[str, tuple[float, float]], bracketed: bool) -> None:
    if not floors:
        return
    when = (
        "in pass 1 (before the fingerprints were profiled) and again in pass 2 (after)"
        if bracketed
        else "again in pass 2"
    )
    print(
        f"\nRepeatability: every full-model job measured {when} (batch 1, 16 output "
        "tokens), |pass 2 / pass 1 - 1| (median / p90 %)"
    )
    print("  " + ", ".join(f"{k} {m:.1f} / {p:.1f}" for k, (m, p) in floors.items()))


# ---- estimates -----------------------------------------------------------------------------
def estimate(est_stub, model_id: str) -> dict[tuple[str, int, int], est_pb.ConfigEstimate]:
    reply = est_stub.EstimateConfigs(
        est_pb.EstimateConfigsRequest(
            model_id=model_id,
            hardware_type=HARDWARE,
            workload=est_pb.Workload(
                input_tokens=INPUT_TOKENS, output_tokens=EVAL_OUTPUT, batch_size=1
            ),
            device_count=max(max(tp * pp for tp, pp in LAYOUTS), 1),
        )
    )
    out = {}
    for e in reply.estimates:
        c = e.config
        if (c.batch_size or 1) == 1:
            out[(c.variant_name or "base", c.tensor_parallel, c.pipeline_parallel)] = e
    return out


def set_profiles(settings, profiles, with_full: set[str]) -> None:
    """Store each model's profile; full-model rows only for the models in ``with_full``."""

    async def put(store):
        for model_id, (fingerprints, full) in profiles.items():
            message = model_pb.GetProfileResponse()
            message.CopyFrom(fingerprints)
            if model_id in with_full:
                message.measurements.extend(full)
            await store.put_profile(message)

    run_async(_with_store(settings, put))


def errors(est, measured) -> dict[str, list[tuple[str, float]]]:
    """Per metric, (model, APE %) of every measured full-model point."""
    out = {k: [] for k in ("latency", "TTFT", "TPOT", "memory")}
    for (model_id, variant, tp, pp), m in measured.items():
        e = est[model_id][(variant, tp, pp)]
        pairs = {
            "latency": (e.latency_ms, m.latency_ms),
            "TTFT": (e.ttft_ms, m.ttft_ms),
            "TPOT": (e.tpot_ms, m.tpot_ms),
            "memory": (e.memory_total_bytes, sum(m.peak_memory_bytes_per_rank)),
        }
        for k, (a, b) in pairs.items():
            out[k].append((model_id, 100.0 * abs(a / b - 1.0)))
    return out


def print_table(title: str, errs) -> None:
    print(f"\n{title}")
    print(f"{'':12s}" + "".join(f" | {k:^11s}" for k in errs) + "  (median / p90 APE %)")
    for group in (*ARCHS, "all"):
        cells = ""
        for pairs in errs.values():
            v = [e for m, e in pairs if group in ("all", m)]
            cells += f" | {np.median(v):5.1f} {np.percentile(v, 90):5.1f}"
        n = sum(1 for m, _ in errs["latency"] if group in ("all", m))
        print(f"{group:12s}{cells}  ({n} rows)")


def print_points(est, measured) -> None:
    print("\nPer point (batch 1, 64-token prompt, 16 output tokens): measured / LOAO estimate")
    print(
        f"{'model':11s} {'variant':7s} tp pp | {'latency ms':>17s} | {'TTFT ms':>15s} |"
        f" {'TPOT ms':>13s} | {'memory MiB':>15s}"
    )
    for (model_id, variant, tp, pp), m in measured.items():
        e = est[model_id][(variant, tp, pp)]
        mem = sum(m.peak_memory_bytes_per_rank) / 2**20
        print(
            f"{model_id:11s} {variant:7s} {tp:2d} {pp:2d} | {m.latency_ms:7.1f} / {e.latency_ms:7.1f} |"
            f" {m.ttft_ms:6.1f} / {e.ttft_ms:6.1f} | {m.tpot_ms:5.2f} / {e.tpot_ms:5.2f} |"
            f" {mem:6.1f} / {e.memory_total_bytes / 2**20:6.1f}"
        )


def _batch1_clocked(rows, variant: str, tp: int, pp: int) -> list:
    """Rows of ``variant`` at (tp, pp), batch 1, that carry layer-clock figures."""
    return [
        r
        for r in rows
        if r.variant_name == variant
        and (r.config.tensor_parallel, r.config.pipeline_parallel) == (tp, pp)
        and (r.config.batch_size or 1) == 1
        and r.tpot_layer_ms > 0
    ]


def _rank0_layers(row) -> int:
    """Layers of rank 0's stage in a measurement."""
    return row.stage_layers[0] if row.stage_layers else row.num_layers


def print_layer_clocks(fingerprints, full_by_model) -> None:
    """One decoder layer's time inside the runs (the workers' layer clock, rank 0):
    fingerprints (batch 1; those whose rank 0 ran more than one layer, as the estimator
    takes them) against the full model, per layout."""
    print(
        "\nOne decoder layer on rank 0, from the worker's layer clock (ms; batch 1, median "
        "over runs; a stage's layers after its first): fingerprints (rank 0's stage of 2 "
        "layers) / full model"
    )
    print(f"{'model':11s} {'variant':7s} tp pp | {'prefill layer':>15s} | {'decode layer':>13s}")
    for model_id in ARCHS:
        for variant in VARIANTS:
            for tp, pp in LAYOUTS:
                fp = _batch1_clocked(fingerprints[model_id].measurements, variant.name, tp, pp)
                fp = [r for r in fp if _rank0_layers(r) > 1] or fp
                full = _batch1_clocked(full_by_model[model_id], variant.name, tp, pp)
                if not fp or not full:
                    continue
                med = {
                    field: [
                        statistics.median(getattr(r, field) for r in rows) for rows in (fp, full)
                    ]
                    for field in ("ttft_layer_ms", "tpot_layer_ms")
                }
                (fp_f, full_f), (fp_d, full_d) = med["ttft_layer_ms"], med["tpot_layer_ms"]
                print(
                    f"{model_id:11s} {variant.name:7s} {tp:2d} {pp:2d} |"
                    f" {fp_f:6.2f} / {full_f:6.2f} | {fp_d:5.3f} / {full_d:5.3f}"
                )


def sane(message: est_pb.Calibration) -> tuple[bool, str]:
    terms = dict(message.extra_terms)
    values = [message.alpha, message.beta, message.gamma, message.delta, *terms.values()]
    if not all(np.isfinite(values)):
        return False, "non-finite constant"
    scales = [v for k, v in terms.items() if k.startswith("scale.")]
    if any(not 0.5 <= s <= 2.0 for s in scales):
        return False, f"reference scale outside 0.5-2: {scales}"
    if not message.fit_error_percent < 15.0:
        return False, f"fit error {message.fit_error_percent:.1f} %"
    return True, "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="write models and measurements to this JSON file")
    parser.add_argument("--load", type=Path, help="reuse saved measurements (no profiling)")
    parser.add_argument("--timed-runs", type=int, default=5, help="full-model timed runs")
    parser.add_argument(
        "--batch-sizes", default="1,2", help="fingerprint batch sizes profiled (default 1,2)"
    )
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help=f"decoder layers of each model (default {LAYERS}); the shipped calibration's "
        "rows then show how it carries to models of another depth",
    )
    parser.add_argument(
        "--profile-timed-runs", type=int, default=5, help="fingerprint timed runs (default 5)"
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=2,
        help="times every full model is measured, in separate passes (default 2; the first "
        "before the fingerprints are profiled, the others after): the truth is the median "
        "over passes, and the passes' disagreement is printed as the floor",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=2,
        help="virtual CPU devices (default 2); a node with GPUs uses them instead, and the "
        "layouts measured are those this many devices allow",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the checkpoints' dtype (default float32); CUDA serves a checkpoint in its own "
        "dtype, CPUs in float32",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="run the stack in this directory and keep it (its logs/ say what each process "
        "did); default: a temporary one, removed after",
    )
    parser.add_argument("--write-calibration", action="store_true")
    args = parser.parse_args()
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    if args.layers < 4:
        parser.error("--layers must be at least 4 (the fingerprints keep up to 3)")
    if args.save and (args.save.is_dir() or not args.save.parent.is_dir()):
        # Said now, not after minutes of measuring.
        parser.error(f"--save {args.save}: give a file in an existing directory")
    use_layers(args.layers)
    started = time.perf_counter()

    log("starting the stack ...")
    with launcher.temporary_stack(
        {
            "ISERVE_DEVICES": str(args.devices),
            "ISERVE_DEVICE_MEMORY_GIB": "2",
            "ISERVE_PROFILE_INPUT_TOKENS": str(INPUT_TOKENS),
            "ISERVE_PROFILE_OUTPUT_TOKENS": ",".join(map(str, OUTPUT_TOKENS)),
            "ISERVE_PROFILE_BATCH_SIZES": args.batch_sizes,
            "ISERVE_PROFILE_TIMED_RUNS": str(args.profile_timed_runs),
        },
        state_dir=args.state_dir,
    ) as settings:
        ch = lambda name: grpc.insecure_channel(settings.address(name))  # noqa: E731
        models_stub = model_service_pb2_grpc.ModelServiceStub(ch("model"))
        deploy_stub = deployment_service_pb2_grpc.DeploymentServiceStub(ch("deploy"))
        est_stub = estimator_service_pb2_grpc.EstimatorServiceStub(ch("estimator"))
        node = describe_node(deploy_stub)
        if args.load:
            raw = json.loads(args.load.read_text())
            # Saved on another node (a GPU's, say): estimate for that node's hardware.
            node = raw.get("node", node)
            models = {
                k: json_format.ParseDict(v, model_pb.Model()) for k, v in raw["models"].items()
            }
            fingerprints = {
                k: json_format.ParseDict(v, model_pb.GetProfileResponse())
                for k, v in raw["profiles"].items()
            }
            # Files saved before --passes hold one pass under "full".
            full_passes = [
                [json_format.ParseDict(r, model_pb.ProfileMeasurement()) for r in rows]
                for rows in raw.get("full_passes", [raw.get("full", [])])
            ]

            async def put_models(store):
                for m in models.values():
                    await store.put_model(m)

            run_async(_with_store(settings, put_models))
            use_layers(next(iter(models.values())).shape.num_layers)
            profile_s = raw.get("profile_s", 0.0)
            measure_s = raw.get("measure_s", 0.0)
            use_node(node, raw.get("devices", 2))
            args.dtype = raw.get("dtype", "float32")
            # Files saved before the passes bracketed the profiling hold passes after it.
            bracketed = raw.get("bracketed", False)
        else:
            use_node(node, args.devices)
            write_checkpoints(settings, args.hidden, args.dtype)
            # The first pass of the full models before the fingerprints are profiled, the
            # others after: the passes bracket the fingerprints' measurements, so their
            # disagreement (the floor) spans the machine's drift over that time, which
            # no estimate from the fingerprints can undo.
            t0 = time.perf_counter()
            full_passes = [measure_full_models(settings, deploy_stub, args.timed_runs, 0)]
            measure_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            models = register_and_profile(settings, models_stub)
            profile_s = time.perf_counter() - t0
            fingerprints = {
                m: models_stub.GetProfile(model_pb.GetProfileRequest(model_id=m)) for m in ARCHS
            }
            t0 = time.perf_counter()
            full_passes += [
                measure_full_models(settings, deploy_stub, args.timed_runs, n)
                for n in range(1, args.passes)
            ]
            measure_s += time.perf_counter() - t0
            bracketed = True
            if args.save:
                args.save.write_text(
                    json.dumps(
                        {
                            "models": {k: json_format.MessageToDict(v) for k, v in models.items()},
                            "profiles": {
                                k: json_format.MessageToDict(v) for k, v in fingerprints.items()
                            },
                            "full_passes": [
                                [json_format.MessageToDict(r) for r in rows] for rows in full_passes
                            ],
                            "profile_s": profile_s,
                            "measure_s": measure_s,
                            "node": node,
                            "devices": args.devices,
                            "dtype": args.dtype,
                            "bracketed": bracketed,
                        }
                    )
                )
        full_rows = combine_passes(full_passes)
        hardware = {r.hardware_type for r in full_rows}
        assert hardware == {HARDWARE}, hardware
        full_by_model = {m: [] for m in ARCHS}
        measured = {}
        # Full-model rows carry no model id: keep them grouped by order.
        for i, model_id in enumerate(ARCHS):
            per = rows_per_model()
            full_by_model[model_id] = full_rows[i * per : (i + 1) * per]
            for r in full_by_model[model_id]:
                if r.output_tokens == EVAL_OUTPUT:
                    key = (
                        model_id,
                        r.variant_name,
                        r.config.tensor_parallel,
                        r.config.pipeline_parallel,
                    )
                    measured[key] = r
        measured = dict(sorted(measured.items()))
        profiles = {m: (fingerprints[m], full_by_model[m]) for m in ARCHS}

        # 1. The calibration shipped before (no full-model rows stored).
        log("estimating with the shipped calibration ...")
        set_profiles(settings, profiles, with_full=set())
        try:
            shipped = est_stub.GetCalibration(est_pb.GetCalibrationRequest(hardware_type=HARDWARE))
            est_shipped = {m: estimate(est_stub, m) for m in ARCHS}
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            shipped, est_shipped = None, None  # none shipped for this hardware (a GPU's)

        # 2. Leave one architecture out.
        est_loao, folds = {}, []
        for held in ARCHS:
            train = [m for m in ARCHS if m != held]
            log(f"calibrating without {held} ...")
            set_profiles(settings, profiles, with_full=set(train))
            cal = est_stub.Calibrate(
                est_pb.CalibrateRequest(hardware_type=HARDWARE, model_ids=train)
            ).calibration
            folds.append((held, cal))
            est_loao[held] = estimate(est_stub, held)

        # 3. All three (in-sample) and the calibration to ship.
        log("calibrating on all three ...")
        set_profiles(settings, profiles, with_full=set(ARCHS))
        final = est_stub.Calibrate(
            est_pb.CalibrateRequest(hardware_type=HARDWARE, model_ids=list(ARCHS))
        ).calibration
        # In-sample estimates: the held-out rows must not be in the references'
        # samples, so estimate with the fingerprint-only profiles.
        set_profiles(settings, profiles, with_full=set())
        est_all = {m: estimate(est_stub, m) for m in ARCHS}

    usable = max(tp * pp for tp, pp in LAYOUTS)
    if node["kind"] == "cuda":
        print(
            f"Estimation accuracy on CUDA: {usable} x {node['name']} "
            f"({node['total_bytes'] / 2**30:.0f} GiB; hardware type {HARDWARE})"
        )
    else:
        print(
            f"Estimation accuracy on this CPU ({usable} virtual device(s), one core each; "
            f"{os.cpu_count()} cores; another job may share the machine)"
        )
    for model_id, shape in ARCHS.items():
        shape.setdefault("hidden_size", models[model_id].shape.hidden_size)
    described = [
        f"{m} ({a['arch']}, {LAYERS} layers, hidden {a['hidden_size']}, {a['num_heads']} heads, "
        f"{a.get('num_kv_heads', a['num_heads'])} KV)"
        for m, a in ARCHS.items()
    ]
    print(f"models: {', '.join(described)}; checkpoints in {args.dtype}")
    print(f"variants: {', '.join(v.name for v in VARIANTS)} (int8 = int8 weight-only)")
    print(
        f"fingerprints: profiled by the real profiler at {layouts_text()}, batch {args.batch_sizes}, "
        f"prompt {INPUT_TOKENS}, outputs {OUTPUT_TOKENS} ({profile_s:.0f} s for the three models)"
    )
    print(
        f"full models: RunProfilingJob at {layouts_text()}, batch 1, prompt {INPUT_TOKENS}, "
        f"outputs {OUTPUT_TOKENS}, 1 warm-up + {args.timed_runs} timed runs (medians), "
        f"{len(full_passes)} pass(es) "
        + (
            "(the first before the profiling, the others after), "
            if bracketed
            else "(after the profiling), "
        )
        + f"the median over passes compared; {measure_s:.0f} s; "
        f"(2,2) skipped: needs 4 devices, this node has {usable}"
    )
    print(
        f"compared: batch 1, prompt {INPUT_TOKENS}, {EVAL_OUTPUT} output tokens; memory = "
        "sum over ranks of the workers' peak accounting (weights + KV + activation peak) "
        "against EstimateConfigs memory_total_bytes"
    )
    if shipped is None:
        print(f"\nshipped calibration: none for {HARDWARE}")
    else:
        print(f"\nshipped calibration: {shipped.calibration.provenance[:120]}...")
        print_table(
            "Shipped calibration (committed; fitted by an earlier run of this bench)",
            errors(est_shipped, measured),
        )
    loao = errors(est_loao, measured)
    print_table(
        "Leave one architecture out (Calibrate on the other two; targets median <= 5, p90 <= 10)",
        loao,
    )
    print_table("Calibrated on all three (in-sample, reference only)", errors(est_all, measured))
    floors = repeatability(full_passes)
    print_repeatability(floors, bracketed)
    print_points(est_loao, measured)
    print_layer_clocks(fingerprints, full_by_model)
    print("\nCalibrations per fold (TPOT alpha,beta,gamma,delta | scales ttft/tpot | fit %):")
    for held, cal in [*folds, ("(none)", final)]:
        t = dict(cal.extra_terms)
        sc = "/".join(
            ",".join(
                f"{t.get(f'scale.{ph}.{lay}', float('nan')):.2f}" for lay in ("1x1", "2x1", "1x2")
            )
            for ph in ("ttft", "tpot")
        )
        print(
            f"  w/o {held:10s} {cal.alpha:.2f},{cal.beta:.2f},{cal.gamma:.2f},{cal.delta:.2f} | "
            f"{sc} | "
            f"fit {cal.fit_error_percent:.2f} %; peer "
            f"{t.get('memory.tp_peer_gib', 0) * 1024:.2f} MiB"
        )
    verdict = {
        k: (statistics.median(v := [e for _, e in pairs]), float(np.percentile(v, 90)))
        for k, pairs in loao.items()
    }
    print(
        "\nLOAO error beside the machine's repeatability floor (the same full-model job "
        "measured twice); claim: median <= floor median + 2 points"
    )
    for k, (med, p90) in verdict.items():
        floor_med, floor_p90 = floors.get(k, (float("nan"), float("nan")))
        claim = "OK" if med <= floor_med + 2.0 else "MISSED"
        if not floors:
            claim = "no floor (one pass)"
        print(
            f"{k:8s} LOAO median {med:5.1f} % (floor {floor_med:4.1f}, <= floor + 2: {claim}); "
            f"p90 {p90:5.1f} % (floor {floor_p90:4.1f}); absolute targets median <= 5: "
            f"{'OK' if med <= 5 else 'MISSED'}, p90 <= 10: {'OK' if p90 <= 10 else 'MISSED'}"
        )
    ok, why = sane(final)
    print(f"\nfinal calibration (all three): sane = {ok} ({why})")
    print(f"  provenance: {final.provenance}")
    if args.write_calibration:
        if ok:
            message = est_pb.Calibration()
            message.CopyFrom(final)
            # The size of this bench's virtual devices says nothing about another machine's.
            message.extra_terms.pop("device_memory_bytes", None)
            message.provenance = (
                final.provenance
                + f"; written by bench/estimate_cpu.py ({', '.join(ARCHS)}: {LAYERS} layers, "
                f"hidden {args.hidden}, base + int8 weights, 2 virtual CPU devices of one core each, "
                f"prompt {INPUT_TOKENS}, outputs {OUTPUT_TOKENS}; fingerprint layer times "
                "from the workers' layer clock)"
            )
            text = json.dumps(
                json_format.MessageToDict(message, preserving_proto_field_name=True),
                indent=2,
                sort_keys=True,
            )
            (SHIPPED_DIR / f"{HARDWARE}.json").write_text(text + "\n")
            print(f"  written to {SHIPPED_DIR / f'{HARDWARE}.json'}")
        else:
            print("  NOT written: the fit is not sane")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
