"""What fingerprints save: profiling a 32-layer model's fingerprints against profiling
the full model under the same reference configurations.

Method: start the real stack (embedded redis-server, every service, one node agent with
2 virtual CPU devices) in a temporary state directory on free ports, and write a
32-layer Llama checkpoint (hidden 1024, 16 heads, 4 KV heads, MLP 2752, the tokenizer's
640-token vocabulary with tied embeddings; float32, about 1.5 GB).

* Fingerprints: RegisterModel with profiling, WatchModel until PROFILED, then GetProfile:
  the profiler's own record of the cost. It ran its jobs as it always does, the
  fingerprints of 1 and 2 layers at (1,1), 2 and 3 at (1,2), 1 and 2 at (2,1), each at
  batch 1 and 2, every job a RunProfilingJob on the agent.
* Full model: the same jobs (same references, batch sizes, prompt, output lengths,
  warm-up and timed repetitions, built with the profiler's ``ProfileJob``), with the
  32-layer checkpoint itself in place of the fingerprints, one per (reference, batch),
  sent to the same agent's RunProfilingJob one after another.

Both sides are counted as the profiler counts: device-seconds = Σ over jobs of the
job's devices × the RunProfilingJob call's wall time (worker start-up and stop
included), peak memory = the largest per-rank peak any run reported (on CPU the
worker's account of weights + KV cache + its measured peak activations). The breakdown splits
device-seconds into generation (Σ over output lengths of the median run latency ×
(warm-up + timed runs) × devices) and the rest (starting the workers, loading weights,
stopping them, RPCs).

Why this width: the per-rank peak of the fingerprint runs is that of the 2-layer
fingerprint at (1,1), so the memory ratio is at most about 32/2 = 16 and only comes near
it when a layer dwarfs what every rank holds whatever its layer count (embeddings, LM
head, activations). Hidden 1024 with the small tied vocabulary makes a layer ~46 MB
against a few MB of the rest at 16 prompt tokens. The service's default prompts (64, 256
and 1024 tokens) make the activations of a 1024-token prompt at batch 2 (~70 MB measured)
bigger than the fingerprint's two layers, and the ratio falls to ~10× whatever the
fingerprints do: at this width the default only shows the device-seconds. A wider model
would raise the bound but the full model would no longer profile in minutes on 2 cores.

On a machine with NVIDIA GPUs the agent finds them through NVML and the same jobs run
there (the references the node's devices allow; with one GPU, (1,1) at batch 1 and 2).
A Llama-2-7B-shaped model on one GPU: ``--hidden 4096 --heads 32 --kv-heads 32
--intermediate 11008 --dtype bfloat16`` (13 GB of weights).

Run: .venv/bin/python bench/profiling_cost.py [--input-tokens 16] [--hidden 1024]
     [--intermediate N] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fingerprint_svc.fingerprints import FingerprintCache  # noqa: E402
from fingerprint_svc.profile_plan import (  # noqa: E402
    ProfileJob,
    ProfilingSettings,
    plan_jobs,
)
from services.api import agent_service_pb2 as agent_pb  # noqa: E402
from services.api import (  # noqa: E402
    agent_service_pb2_grpc,
    deployment_service_pb2_grpc,  # noqa: E402
    model_service_pb2_grpc,
)
from services.api import deployment_service_pb2 as deploy_pb  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.cli import stack as launcher  # noqa: E402
from services.estimation.space import ModelShape, Variant, enumerate_space  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402

MIB = 1 << 20
MODEL_ID = "bench-32l"
LAYERS = 32


def generation_seconds(runs, settings: ProfilingSettings) -> float:
    """Seconds a job spent generating: every output length's median latency times the
    runs made at it (warm-up included)."""
    per_length = settings.warmup_runs + settings.timed_runs
    return sum(r.latency_ms / 1e3 for r in runs) * per_length


def profile_fingerprints(settings, models, profiling: ProfilingSettings):
    """Register with profiling, wait, return (profile, wall s, generation device-s)."""
    started = time.perf_counter()
    models.RegisterModel(
        model_pb.RegisterModelRequest(model_id=MODEL_ID, checkpoint_path=MODEL_ID), timeout=60
    )
    last = None
    for last in models.WatchModel(model_pb.WatchModelRequest(model_id=MODEL_ID), timeout=3600):
        print(f"  fingerprints: {last.runs_done}/{last.runs_total} {last.current}", file=sys.stderr)
    wall = time.perf_counter() - started
    if last is None or last.state != model_pb.MODEL_STATE_PROFILED:
        raise SystemExit(f"fingerprint profiling did not finish: {last}")
    profile = models.GetProfile(model_pb.GetProfileRequest(model_id=MODEL_ID))
    jobs = collections.defaultdict(list)
    for m in profile.measurements:
        key = (
            m.config.tensor_parallel,
            m.config.pipeline_parallel,
            m.num_layers,
            m.config.batch_size,
        )
        jobs[key].append(m)
    generation = sum(
        generation_seconds(runs, profiling) * tp * pp for (tp, pp, _, _), runs in jobs.items()
    )
    return profile, wall, generation, len(jobs)


def profile_full_model(settings, models, agent, device_ids, profiling: ProfilingSettings):
    """Every fingerprint job's (reference, batch) on the full checkpoint, through the
    agent's RunProfilingJob; returns per-job rows."""
    model = models.GetModel(model_pb.GetModelRequest(model_id=MODEL_ID)).model
    fingerprint_jobs, skipped = plan_jobs(model, profiling, len(device_ids))
    if skipped:
        print(f"  skipped references: {skipped}", file=sys.stderr)
    full = FingerprintCache(settings.models_root).fingerprint(model.checkpoint_path, LAYERS)
    assert full.full_model
    seen, rows = set(), []
    for fj in fingerprint_jobs:
        key = (fj.tensor_parallel, fj.pipeline_parallel, fj.batch_size)
        if key in seen:
            continue
        seen.add(key)
        job = ProfileJob(
            fj.variant, fj.tensor_parallel, fj.pipeline_parallel, LAYERS, fj.batch_size
        )
        request = agent_pb.RunProfilingJobRequest(
            request_id=f"bench-full-{len(rows)}",
            checkpoint_path=full.checkpoint_path,
            config=job.config(),
            workers=job.worker_specs(device_ids[: job.ranks]),
            input_tokens=profiling.input_tokens[0],
            extra_input_tokens=profiling.input_tokens[1:],
            output_tokens=profiling.output_tokens,
            warmup_runs=profiling.warmup_runs,
            timed_runs=profiling.timed_runs,
        )
        started = time.perf_counter()
        reply = agent.RunProfilingJob(request, timeout=3600)
        wall = time.perf_counter() - started
        peak = max(max(r.peak_memory_bytes_per_rank) for r in reply.runs)
        gen = generation_seconds(reply.runs, profiling)
        rows.append((job, wall, gen, peak, reply.runs))
        print(
            f"  full model tp={job.tensor_parallel} pp={job.pipeline_parallel} "
            f"batch={job.batch_size}: {wall:.1f} s wall ({gen:.1f} s generating), "
            f"peak {peak / MIB:.0f} MiB",
            file=sys.stderr,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument(
        "--intermediate", type=int, default=None, help="MLP width (default: derived)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the checkpoint's dtype (CUDA serves it in that dtype, CPUs in float32)",
    )
    parser.add_argument(
        "--input-tokens",
        default="16",
        help="prompt lengths, comma-separated (default 16; the service profiles 64,256,1024: "
        "pass that for its cost, about 20 minutes)",
    )
    parser.add_argument("--output-tokens", default="8,16", help="output lengths (default 8,16)")
    parser.add_argument("--timed-runs", type=int, default=3)
    parser.add_argument("--warmup-runs", type=int, default=1)
    parser.add_argument(
        "--space-devices",
        type=int,
        default=8,
        help="devices of the brute-force configuration space (default 8, the papers' box)",
    )
    args = parser.parse_args()

    profile_env = {
        "ISERVE_PROFILE_INPUT_TOKENS": args.input_tokens,
        "ISERVE_PROFILE_OUTPUT_TOKENS": args.output_tokens,
        "ISERVE_PROFILE_BATCH_SIZES": "1,2",
        "ISERVE_PROFILE_WARMUP_RUNS": str(args.warmup_runs),
        "ISERVE_PROFILE_TIMED_RUNS": str(args.timed_runs),
    }
    profiling = ProfilingSettings.from_env(profile_env)
    print("starting the stack ...", file=sys.stderr)
    with launcher.temporary_stack(
        {
            "ISERVE_DEVICES": "2",
            "ISERVE_DEVICE_MEMORY_GIB": "6",
            "ISERVE_READY_TIMEOUT_S": "600",
            **profile_env,
        }
    ) as settings:
        create_checkpoint(
            settings.models_root / MODEL_ID,
            hidden_size=args.hidden,
            num_layers=LAYERS,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate,
            dtype=args.dtype,
            tie_word_embeddings=True,
        )
        models = model_service_pb2_grpc.ModelServiceStub(
            grpc.insecure_channel(settings.address("model"))
        )
        agent = agent_service_pb2_grpc.AgentServiceStub(
            grpc.insecure_channel(settings.address("agent"))
        )
        cluster = deployment_service_pb2_grpc.DeploymentServiceStub(
            grpc.insecure_channel(settings.address("deploy"))
        ).GetClusterState(deploy_pb.GetClusterStateRequest())
        devices = [d for n in cluster.nodes for d in n.devices]
        device_ids = sorted(d.ref.device_id for d in devices)
        on = f"{len(devices)} x {devices[0].name} ({devices[0].hardware_type})"
        print("profiling the fingerprints ...", file=sys.stderr)
        profile, fp_wall, fp_gen, fp_jobs = profile_fingerprints(settings, models, profiling)
        print("profiling the full model ...", file=sys.stderr)
        full_rows = profile_full_model(settings, models, agent, device_ids, profiling)
        model = models.GetModel(model_pb.GetModelRequest(model_id=MODEL_ID)).model
        shape = model.shape
        planned, _ = plan_jobs(model, profiling, len(device_ids))
    # Layer-device units: what the jobs cost at equal per-layer cost and no fixed cost.
    fp_units = sum(job.ranks * job.num_layers for job in planned)
    full_units = sum(
        tp * pp * LAYERS
        for tp, pp, _ in {(j.tensor_parallel, j.pipeline_parallel, j.batch_size) for j in planned}
    )

    fp_ds = profile.cost.device_seconds
    fp_peak = profile.cost.peak_device_memory_bytes
    full_ds = sum(job.ranks * wall for job, wall, _, _, _ in full_rows)
    full_gen = sum(job.ranks * gen for job, _, gen, _, _ in full_rows)
    full_peak = max(peak for *_, peak, _ in full_rows)
    full_wall = sum(wall for _, wall, *_ in full_rows)
    print(
        f"profiling cost: {LAYERS}-layer Llama (hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads / {shape.num_kv_heads} KV, MLP "
        f"{shape.intermediate_size}, vocab {shape.vocab_size} tied; "
        f"{shape.weight_bytes / MIB:.0f} MiB of weights, {args.dtype}) on {on}, "
        f"{os.cpu_count()} cores"
    )
    print(
        f"references (1,1) (1,2) (2,1) x batch 1,2; prompts "
        f"{','.join(map(str, profiling.input_tokens))} tokens, "
        f"outputs {','.join(map(str, profiling.output_tokens))}; {profiling.warmup_runs} warm-up "
        f"+ {profiling.timed_runs} timed runs per prompt and output length; device-seconds = sum of "
        "devices x RunProfilingJob wall time; peak = largest per-rank peak"
    )
    if profile.skipped:
        print(f"skipped by the profiler: {list(profile.skipped)}")
    print(
        f"{'':<26}{'jobs':>6}{'wall s':>9}{'device-s':>10}{'generating':>12}{'start/stop':>12}{'peak MiB':>10}"
    )
    print(
        f"{'fingerprints (1-3 layers)':<26}{fp_jobs:>6}{fp_wall:>9.1f}{fp_ds:>10.1f}"
        f"{fp_gen:>12.1f}{fp_ds - fp_gen:>12.1f}{fp_peak / MIB:>10.1f}"
    )
    print(
        f"{f'full model ({LAYERS} layers)':<26}{len(full_rows):>6}{full_wall:>9.1f}{full_ds:>10.1f}"
        f"{full_gen:>12.1f}{full_ds - full_gen:>12.1f}{full_peak / MIB:>10.1f}"
    )
    mem_ratio = full_peak / fp_peak
    ds_ratio = full_ds / fp_ds
    print(
        f"peak memory ratio {mem_ratio:.1f}x (target >= 15x): {'OK' if mem_ratio >= 15 else 'MISSED'}"
    )
    print(
        f"device-seconds ratio against full-model references {ds_ratio:.1f}x "
        f"(target >= 6x): {'OK' if ds_ratio >= 6 else 'MISSED'}"
    )
    print(
        f"generation-only device-seconds ratio {full_gen / fp_gen:.1f}x; start-up/stop is "
        f"{(fp_ds - fp_gen) / fp_ds:.0%} of the fingerprints' device-seconds "
        f"({(fp_ds - fp_gen) / max(1, sum(j for j in [fp_jobs])):.1f} device-s per job)"
    )
    print(
        f"bound: the fingerprint jobs run {fp_units} layer x device units, the full model "
        f"{full_units}; at equal per-layer cost and no start-up or per-token cost the "
        f"device-seconds ratio is at most {full_units / fp_units:.1f}x with these references"
    )
    per_job_startup = statistics.median(wall - gen for _, wall, gen, _, _ in full_rows)
    print(f"full-model start-up/stop per job (median): {per_job_startup:.1f} s")
    brute_force(shape, full_rows, fp_ds, args.space_devices, per_job_startup)
    return 0


def brute_force(shape, full_rows, fp_ds: float, devices: int, startup_s: float) -> None:
    """AlpaServe-style brute force: the full model profiled under every (tp, pp, batch)
    the estimator scores on ``devices`` devices (one variant, as the fingerprints above).
    A configuration this machine ran in full above counts its measured device-seconds;
    one needing more devices than it has is computed from what was measured: tp x pp x
    (the median full-model start-up/stop + the generating wall time of the (1,1) job at
    that batch, since at batch 1-2 the stages run one after another and the layers cost
    what they cost on one device)."""
    space = enumerate_space(
        ModelShape(
            "bench",
            shape.num_layers,
            shape.num_attention_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.intermediate_size,
        ),
        devices,
        (Variant("base"),),
        (1, 2),
    )
    measured = {
        (job.tensor_parallel, job.pipeline_parallel, job.batch_size): job.ranks * wall
        for job, wall, *_ in full_rows
    }
    generating_11 = {job.batch_size: gen for job, _, gen, _, _ in full_rows if job.ranks == 1}
    total = computed = 0.0
    n_measured = n_computed = 0
    for tp, pp, batch in sorted(
        {(int(c["tp"]), int(c["pp"]), int(c["batch"])) for c in space.configs}
    ):
        if (tp, pp, batch) in measured:
            total += measured[(tp, pp, batch)]
            n_measured += 1
        else:
            cost = tp * pp * (startup_s + generating_11[batch])
            total += cost
            computed += cost
            n_computed += 1
    print(
        f"brute force over the estimator's space on {devices} devices: "
        f"{n_measured + n_computed} configurations (tp x pp x batch 1,2), "
        f"{n_measured} measured in full above, {n_computed} computed from the measured "
        f"per-job start-up and (1,1) generating time ({computed:.0f} of {total:.0f} "
        f"device-s); against the fingerprints: {total / fp_ds:.1f}x (target >= 15x)"
    )


if __name__ == "__main__":
    sys.exit(main())
