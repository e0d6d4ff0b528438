"""Estimates for prompts of other lengths than the profiled ones, against full-model runs.

Method: start the real stack (embedded redis-server, every service, one node agent with
one virtual CPU device) in a temporary state directory on free ports, with the
profiler's default prompt lengths (``ISERVE_PROFILE_INPUT_TOKENS``: 64, 256 and 1024) and
the outputs 8 and 16. Create three 24-layer checkpoints (Llama-, Falcon- and GPT-J-style,
hidden 512 by default, a 4096-token context) and register each with profiling: the real
profiler runs 1- and 2-layer fingerprints at (1,1), batch 1 and 2, at every prompt
length. Then each full model runs at (1,1), batch 1, through the same
``AgentService.RunProfilingJob`` path, at every prompt of ``--prompts`` (default 64, 256,
512, 1024, 2048) in one worker, shortest first.

``EstimateConfigs`` (batch 1, 16 output tokens, 1 device) at each of those prompts is
compared with the measured TTFT and end-to-end latency at 16 output tokens:

  service  the service's rule: the parabola through the three profiled prompts (within
           its neighbours' figures between two of them, no lower than the line through
           the two longest beyond them);
  line     the line through the two profiled prompts nearest (beyond the longest: the
           two longest), what a profile of two prompt lengths gives;
  one      a profile of one prompt (the profiler's default before, 64 tokens): that
           prompt's figures for every prompt;
  grown    the service's rule for a profile of one prompt length (an import of one
           prompt's measurements): TTFT along prefill's work, n + k n^2 (k from the
           architecture), on the line through that prompt's TTFT and a one-token
           prompt's (a decode step: its TPOT); the latency moved by as much. From the
           shortest profiled prompt (64 tokens), so every prompt is at or beyond it;
  shrunk   the same rule from the longest profiled prompt (1024 tokens) alone: the
           shorter prompts below it, on the same line (a chord of prefill's time).

Calibration: whatever the stack ships for the node's hardware type
(``estimator_svc/calibrations``), fitted on 64-token runs; this bench fits nothing.

Run: .venv/bin/python bench/prompt_lengths.py [--hidden 512]
     [--prompts 64,256,512,1024,2048] [--timed-runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fingerprint_svc.profile_plan import ProfileJob, VariantTarget  # noqa: E402
from services.api import agent_service_pb2 as agent_pb  # noqa: E402
from services.api import (  # noqa: E402
    agent_service_pb2_grpc,
    deployment_service_pb2_grpc,
    estimator_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import deployment_service_pb2 as deploy_pb  # noqa: E402
from services.api import estimator_service_pb2 as est_pb  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.cli import stack as launcher  # noqa: E402
from services.estimation import model_references, profiles  # noqa: E402
from services.estimation.prompt_curve import grown_ttft, prefill_along  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from services.settings import ProfilingSettings  # noqa: E402

LAYERS = 24
OUTPUT_TOKENS = (8, 16)
EVAL_OUTPUT = 16
ARCHS = {
    "pl-llama": dict(arch="llama", num_heads=8, num_kv_heads=4),
    "pl-falcon": dict(arch="falcon", num_heads=8, num_kv_heads=1),
    "pl-gptj": dict(arch="gptj", num_heads=8),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def profile(models, settings, hidden: int) -> None:
    for model_id, shape in ARCHS.items():
        create_checkpoint(
            settings.models_root / model_id,
            num_layers=LAYERS,
            hidden_size=hidden,
            max_position_embeddings=4096,
            **shape,
        )
        models.RegisterModel(
            model_pb.RegisterModelRequest(model_id=model_id, checkpoint_path=model_id)
        )
        last = None
        for last in models.WatchModel(model_pb.WatchModelRequest(model_id=model_id), timeout=1800):
            log(f"  {model_id}: {last.runs_done}/{last.runs_total} {last.current}")
        if last is None or last.state != model_pb.MODEL_STATE_PROFILED:
            raise RuntimeError(f"{model_id} was not profiled: {last}")


def measure(deploy, prompts, timed_runs: int) -> dict[tuple[str, int], agent_pb.ProfiledRun]:
    """Full-model runs at (1,1), batch 1: (model, prompt) -> the 16-token run."""
    cluster = deploy.GetClusterState(deploy_pb.GetClusterStateRequest())
    node = next(n for n in cluster.nodes if n.alive)
    agent = agent_service_pb2_grpc.AgentServiceStub(grpc.insecure_channel(node.agent_address))
    out = {}
    for model_id in ARCHS:
        job = ProfileJob(VariantTarget("base", model_id), 1, 1, LAYERS, 1)
        started = time.perf_counter()
        reply = agent.RunProfilingJob(
            agent_pb.RunProfilingJobRequest(
                request_id=f"bench-{model_id}",
                checkpoint_path=model_id,
                config=job.config(),
                workers=job.worker_specs([node.devices[0].ref.device_id]),
                input_tokens=prompts[0],
                extra_input_tokens=prompts[1:],
                output_tokens=OUTPUT_TOKENS,
                warmup_runs=1,
                timed_runs=timed_runs,
            ),
            timeout=3600,
        )
        for run in reply.runs:
            if run.output_tokens == EVAL_OUTPUT:
                out[(model_id, run.input_tokens)] = run
        log(f"full model {model_id}: {time.perf_counter() - started:.0f} s")
    return out


def estimate(estimator, hardware: str, model_id: str, prompt: int) -> est_pb.ConfigEstimate:
    reply = estimator.EstimateConfigs(
        est_pb.EstimateConfigsRequest(
            model_id=model_id,
            hardware_type=hardware,
            workload=est_pb.Workload(input_tokens=prompt, output_tokens=EVAL_OUTPUT, batch_size=1),
            device_count=1,
        )
    )
    return next(
        e
        for e in reply.estimates
        if (e.config.tensor_parallel, e.config.pipeline_parallel) == (1, 1)
        and (e.config.batch_size or 1) == 1
        and not e.config.variant_name
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompts", default="64,256,512,1024,2048")
    parser.add_argument("--timed-runs", type=int, default=3)
    args = parser.parse_args()
    prompts = sorted({int(p) for p in args.prompts.split(",")})
    profiled = ProfilingSettings().input_tokens
    started = time.perf_counter()
    with launcher.temporary_stack(
        {
            "ISERVE_DEVICES": "1",
            "ISERVE_DEVICE_MEMORY_GIB": "4",
            "ISERVE_PROFILE_OUTPUT_TOKENS": ",".join(map(str, OUTPUT_TOKENS)),
        }
    ) as settings:
        ch = lambda name: grpc.insecure_channel(settings.address(name))  # noqa: E731
        models = model_service_pb2_grpc.ModelServiceStub(ch("model"))
        deploy = deployment_service_pb2_grpc.DeploymentServiceStub(ch("deploy"))
        estimator = estimator_service_pb2_grpc.EstimatorServiceStub(ch("estimator"))
        hardware = (
            deploy.GetClusterState(deploy_pb.GetClusterStateRequest()).nodes[0].devices[0]
        ).hardware_type
        log("profiling ...")
        profile(models, settings, args.hidden)
        log("measuring the full models ...")
        measured = measure(deploy, prompts, args.timed_runs)
        rows = []
        for model_id in ARCHS:
            at = {n: estimate(estimator, hardware, model_id, n) for n in (*profiled, *prompts)}
            record = models.GetModel(model_pb.GetModelRequest(model_id=model_id)).model
            k = model_references._attention_share(profiles.estimation_shape(record))
            for prompt in prompts:
                rows.append(
                    (
                        model_id,
                        prompt,
                        measured[(model_id, prompt)],
                        at[prompt],
                        _line(at, profiled, prompt),
                        at[profiled[0]],
                        _grown(at[profiled[0]], profiled[0], prompt, k),
                        _grown(at[profiled[-1]], profiled[-1], prompt, k),
                    )
                )

    print(
        f"{len(ARCHS)} models, {LAYERS} layers, hidden {args.hidden}, on {hardware}; "
        f"fingerprints profiled at prompts {', '.join(map(str, profiled))}; full models "
        f"measured at (1,1), batch 1, {EVAL_OUTPUT} output tokens "
        f"({time.perf_counter() - started:.0f} s in all)"
    )
    print(
        "estimate / measured - 1, %, of TTFT and latency: the service's rule, the line "
        f"through two profiled prompts, one profiled prompt ({profiled[0]} tokens) as it "
        f"is and grown with prefill's work, and one ({profiled[-1]} tokens) moved so"
    )
    print(
        f"{'model':<10}{'prompt':>7}{'TTFT ms':>9}{'service':>9}{'line':>8}{'one':>8}"
        f"{'grown':>8}{'shrunk':>8}{'latency ms':>12}{'service':>9}{'line':>8}{'one':>8}"
        f"{'grown':>8}{'shrunk':>8}"
    )
    unprofiled: dict[str, list[float]] = {}
    below: dict[str, list[float]] = {}
    for model_id, prompt, m, *rules in rows:
        ttft = [100.0 * (e.ttft_ms / m.ttft_ms - 1.0) for e in rules]
        latency = [100.0 * (e.latency_ms / m.latency_ms - 1.0) for e in rules]
        print(
            f"{model_id:<10}{prompt:>7}{m.ttft_ms:>9.1f}"
            + "".join(f"{v:>+9.1f}" if i == 0 else f"{v:>+8.1f}" for i, v in enumerate(ttft))
            + f"{m.latency_ms:>12.1f}"
            + "".join(f"{v:>+9.1f}" if i == 0 else f"{v:>+8.1f}" for i, v in enumerate(latency))
        )
        if prompt not in profiled:
            for name, values in (("TTFT", ttft), ("latency", latency)):
                rules = ("service", "line", "one", "grown", "shrunk")
                for rule, value in zip(rules, values, strict=True):
                    unprofiled.setdefault(f"{name} {rule}", []).append(abs(value))
        if prompt < profiled[-1]:  # below the one prompt "shrunk" was profiled at
            for name, values in (("TTFT", ttft), ("latency", latency)):
                below.setdefault(name, []).append(values[-1])
    if unprofiled:
        print(
            "prompts not profiled, median |error| %: "
            + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in unprofiled.items())
        )
    if below:
        print(
            f"shrunk, prompts below {profiled[-1]} tokens, signed error % (min / median / "
            "max): "
            + ", ".join(
                f"{k} {min(v):+.1f} / {statistics.median(v):+.1f} / {max(v):+.1f}"
                for k, v in below.items()
            )
        )


def _grown(one: est_pb.ConfigEstimate, length: int, prompt: int, k: float | None):
    """The estimate a profile of one ``length``-token prompt gives at ``prompt``
    (``services.estimation.prompt_curve.profiles_at``): TTFT on the line through it and
    the TPOT in prefill's work, beyond it or below it, the latency moved by as much."""
    out = est_pb.ConfigEstimate()
    out.CopyFrom(one)
    if k is not None and prompt != length:
        along = prefill_along(length, prompt, k)
        grown = float(grown_ttft(np.float64(one.ttft_ms), np.float64(one.tpot_ms), along))
        out.latency_ms += grown - one.ttft_ms
        out.ttft_ms = grown
    return out


def _line(at: dict, profiled: tuple[int, ...], prompt: int) -> est_pb.ConfigEstimate:
    """The estimate a profile of two prompt lengths gives at ``prompt``: the line through
    the two profiled prompts around it (beyond the longest: the two longest), no lower
    than the longer one's beyond it."""
    upper = next((i for i, n in enumerate(profiled) if n >= prompt), len(profiled) - 1)
    low, high = profiled[max(upper - 1, 0)], profiled[max(upper, 1)]
    weight = (prompt - low) / (high - low)
    out = est_pb.ConfigEstimate()
    out.CopyFrom(at[high])
    for field in ("ttft_ms", "latency_ms"):
        a, b = getattr(at[low], field), getattr(at[high], field)
        value = a + weight * (b - a)
        setattr(out, field, max(value, b) if prompt > high else value)
    return out


if __name__ == "__main__":
    main()
