"""How fast the estimator scores and ranks a whole configuration space.

Llama-2-70B on 8 devices: 15 parallel layouts x 12 variants (4 weight quantizations x 2
KV-cache precisions + 4 pruning methods) x batch sizes 1..64 = 11,520 configurations.
Each repeat estimates every configuration (``estimate_space``: memory, TTFT, TPOT,
latency, the three costs, throughput) and ranks them for every intent (``rank``). The
figure is the median over repeats divided by the number of configurations; target
<= 20 µs per configuration. The references are synthetic but shaped like a real
profile (the time does not depend on their values).

If ``aiconfigurator`` is importable, its search for the same model on 8 GPUs is timed
in the same run and printed beside it; otherwise the line says why not.

Run: ``python bench/search_speed.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.estimation.latency import (  # noqa: E402
    ParallelConstants,
    PhaseConstants,
    ReferenceScales,
)
from services.estimation.memory import MemoryConstants  # noqa: E402
from services.estimation.references import ReferenceProfile, VariantProfile  # noqa: E402
from services.estimation.score import Calibration, Intent, estimate_space, rank  # noqa: E402
from services.estimation.space import ModelShape, enumerate_space, standard_variants  # noqa: E402

LLAMA_2_70B = ModelShape("llama-2-70b", num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128)
LAYOUTS = ((1, 1), (2, 1), (1, 2), (4, 1), (8, 1))
# Constants of the order the A6000 calibration finds (bench/estimate_a6000.py).
CALIBRATION = Calibration(
    latency=PhaseConstants(
        ttft=ParallelConstants(0.2, 1.5, 0.0, 0.4), tpot=ParallelConstants(0.1, 0.7, 0.5, 0.6)
    ),
    memory=MemoryConstants(
        tp_peer_gib=0.4, layout_residual_gib=(((1, 4), 0.5), ((4, 2), 4.0), ((8, 1), -2.0))
    ),
    reference_scales=ReferenceScales((1.02, 1.02, 1.0), (1.04, 1.0, 1.0)),
)
INTENTS = (
    Intent("min_cost"),
    Intent("min_latency"),
    Intent("min_memory"),
    Intent("min_device_hours"),
    Intent("latency_slo", latency_slo_s=5.0),
    Intent("cost_slo", cost_budget=500.0),
    Intent("max_throughput"),
    Intent("min_cost", accuracy_floor_pct=95.0),
)


def synthetic_profiles(count: int) -> list[VariantProfile]:
    """Reference figures shaped like a 70B model's, a little different per variant."""
    profiles = []
    for i in range(count):
        scale = 1.0 / (1 + i % 4)  # fp16, int8, int4, int4_gptq-like sizes
        ttft = (1.6, 1.0, 1.55, 3.2, 12.0)
        tpot = (0.29 * scale + 0.02, 0.16 * scale + 0.02, 0.28 * scale + 0.02, 0.1, 0.1)
        memory = (130.0 * scale + 2, 131.6 * scale + 3, 131.0 * scale + 3, np.nan, np.nan)
        batch1 = ReferenceProfile(LAYOUTS, ttft, tpot, memory)
        batch2 = ReferenceProfile(
            LAYOUTS, tuple(t * 1.01 for t in ttft), tuple(t * 1.02 for t in tpot), memory
        )
        profiles.append(VariantProfile(batch1, batch2, kv_tokens_profiled=943))
    return profiles


def time_iserve(repeats: int) -> tuple[int, float, float]:
    """(configurations, median seconds per repeat, µs per configuration)."""
    prunings = ("2:4", "structured-10", "structured-20", "structured-30")
    variants = standard_variants(prunings=prunings)
    space = enumerate_space(LLAMA_2_70B, 8, variants, range(1, 65))
    profiles = synthetic_profiles(len(variants))
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        estimates = estimate_space(
            space,
            profiles,
            CALIBRATION,
            output_tokens=100,
            max_seq_len=1024,
            device_memory_gib=44.7,
        )
        for intent in INTENTS:
            rank(estimates, intent)
        timings.append(time.perf_counter() - start)
    median = statistics.median(timings)
    return space.size, median, median / space.size * 1e6


# Llama-2-70B's public config.json, for aiconfigurator (which reads a model directory).
LLAMA_2_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "torch_dtype": "float16",
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def time_aiconfigurator() -> str:
    """Time aiconfigurator's search for Llama-2-70B on 8 GPUs, or say why not.

    Its CLI runs as a subprocess (its own process start and perf-database load are in
    the figure); it has no RTX A6000 data, so the search is for 8 x H100 SXM,
    aggregated serving, 1024 input and 128 output tokens.
    """
    try:
        import aiconfigurator  # noqa: F401
    except Exception as error:  # any import failure means: not available here
        return f"aiconfigurator: not available ({type(error).__name__}: {error})"
    executable = shutil.which("aiconfigurator", path=str(Path(sys.executable).parent))
    if executable is None:
        return "aiconfigurator: importable, but its command-line tool is not installed"
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "llama-2-70b"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(LLAMA_2_70B_CONFIG))
        argv = [
            executable, "cli", "default", "--model-path", str(model_dir), "--total-gpus", "8",
            "--system", "h100_sxm", "--serving-mode", "agg", "--isl", "1024", "--osl", "128",
            "--save-dir", str(Path(scratch) / "out"), "--log-level", "ERROR",
        ]  # fmt: skip
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"aiconfigurator: search did not finish ({type(error).__name__}: {error})"
        elapsed = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"aiconfigurator: search failed with exit code {done.returncode}: {tail[0]}"
    return (
        f"aiconfigurator {version('aiconfigurator')}: its search for Llama-2-70B on 8 GPUs "
        f"(8 x H100 SXM, agg, ISL 1024 / OSL 128) took {elapsed:.1f} s wall, process start "
        "and perf-database load included"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    print(__doc__.split("\n\n")[1])
    configs, median, per_config = time_iserve(args.repeats)
    print(
        f"\niserve: {configs} configurations estimated and ranked for {len(INTENTS)} intents in "
        f"{median * 1e3:.1f} ms (median of {args.repeats}): {per_config:.2f} µs per configuration "
        f"(target <= 20 µs)"
    )
    print(time_aiconfigurator())


if __name__ == "__main__":
    main()
