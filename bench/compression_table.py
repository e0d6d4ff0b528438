"""Resident memory and TPOT of the PyTorch engine under each compression.

Method: write a random-weight checkpoint of a real shape (default: Llama-2-7B's exact
widths, vocabulary and embedding, cut to ``--layers`` decoder layers, stored in bfloat16)
with ``services.models.presets``. Then, for each configuration, start a fresh Python
process (so that no allocator state or page cache of an earlier load counts) that
imports torch and the engine, reads its RSS and peak RSS (``/proc/self/status`` VmRSS,
VmHWM), loads ``Engine(checkpoint, dtype, kv, weight_quant, pruning)`` with
``--max-batch`` KV slots of ``--max-seq-len`` positions, reads them again, and reports

* the engine's tensor accounting (``engine.memory``: weights = parameters + buffers,
  KV cache), in MiB;
* the RSS delta around the load (what the process really holds afterwards) and the
  peak-RSS delta (the high-water mark while loading: layer-by-layer compression keeps
  it below the full-precision model);
* TPOT: one greedy request with a ``--prompt-tokens`` prompt generating
  ``--steps`` + 1 tokens on one thread; the median gap between consecutive tokens
  (sampling and detokenization included, as a client sees them).

The machine is a shared 2-core VM, so other work slows some steps down: every
configuration is measured ``--rounds`` times, rounds one after another, and the table
keeps each configuration's lowest TPOT median (memory figures agree between rounds to
within a few MiB; the first round's are printed). The table is printed as Markdown.

Run: .venv/bin/python bench/compression_table.py [--preset llama-2-7b] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
# (label, dtype, kv cache, weight quantization, pruning)
CONFIGURATIONS = [
    ("fp32", "float32", "none", "none", "none"),
    ("bf16", "bfloat16", "none", "none", "none"),
    ("bf16 + int8 weights", "bfloat16", "none", "int8", "none"),
    ("bf16 + int4 weights (g128)", "bfloat16", "none", "int4", "none"),
    ("bf16 + int8 KV", "bfloat16", "int8", "none", "none"),
    ("bf16 + 2:4 (dense zeros)", "bfloat16", "none", "none", "2:4"),
    ("bf16 + 2:4 (compact)", "bfloat16", "none", "none", "2:4-compact"),
    ("bf16 + structured 25 %", "bfloat16", "none", "none", "structured"),
    ("fp32 + int8 weights", "float32", "none", "int8", "none"),
]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(args: argparse.Namespace) -> dict:
    """Load one configuration in this process and measure it (see the module doc)."""
    import torch

    from monitor_agent.engine.engine import Engine, SamplingConfig

    torch.set_num_threads(1)
    rss, peak = _status_kib("VmRSS"), _status_kib("VmHWM")
    started = time.perf_counter()
    engine = Engine(
        args.checkpoint,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        max_batch=args.max_batch,
        num_threads=1,
        kv_cache_dtype=None if args.kv == "none" else args.kv,
        weight_quant=args.weight_quant,
        pruning=args.pruning,
    )
    load_s = time.perf_counter() - started
    rss_delta = (_status_kib("VmRSS") - rss) * 1024
    peak_delta = (_status_kib("VmHWM") - peak) * 1024
    prompt = list(range(10, 10 + args.prompt_tokens))
    stamps = []
    for _ in engine.generate(prompt, args.steps + 1, SamplingConfig(ignore_eos=True)):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "weights_bytes": engine.memory.weight_bytes,
        "kv_cache_bytes": engine.memory.kv_cache_bytes,
        "rss_delta_bytes": rss_delta,
        "peak_rss_delta_bytes": peak_delta,
        "tpot_ms": statistics.median(gaps) * 1000,
        "load_s": load_s,
    }


def run_all(args: argparse.Namespace) -> None:
    from services.models.presets import create_preset_checkpoint, preset_config

    with tempfile.TemporaryDirectory(prefix="iserve-compression-") as tmp:
        checkpoint = create_preset_checkpoint(
            Path(tmp) / "ckpt", args.preset, num_layers=args.layers, dtype="bfloat16"
        )
        config = preset_config(args.preset, num_layers=args.layers)
        results: dict[str, list[dict]] = {label: [] for label, *_ in CONFIGURATIONS}
        for _ in range(args.rounds):
            for label, dtype, kv, weight_quant, pruning in CONFIGURATIONS:
                command = [
                    sys.executable, __file__, "--measure",
                    "--checkpoint", str(checkpoint),
                    "--dtype", dtype, "--kv", kv,
                    "--weight-quant", weight_quant, "--pruning", pruning,
                    "--max-seq-len", str(args.max_seq_len),
                    "--max-batch", str(args.max_batch),
                    "--prompt-tokens", str(args.prompt_tokens),
                    "--steps", str(args.steps),
                ]  # fmt: skip
                result = subprocess.run(command, check=True, capture_output=True, text=True)
                figures = json.loads(result.stdout.strip().splitlines()[-1])
                results[label].append(figures)
                print(f"measured {label}: {figures}", file=sys.stderr, flush=True)
    print(
        f"{args.preset} cut to {args.layers} layers (hidden {config.get('hidden_size')}, "
        f"vocab {config.get('vocab_size')}), bf16 checkpoint; KV cache {args.max_batch} slots × "
        f"{args.max_seq_len} positions; TPOT: median of {args.steps} decode steps after a "
        f"{args.prompt_tokens}-token prompt, 1 thread, lowest of {args.rounds} rounds.\n"
    )
    print(
        "| configuration | weights MiB | KV cache MiB | RSS Δ MiB | peak RSS Δ MiB "
        "| TPOT ms | load s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, measured in results.items():
        f = {**measured[0], "tpot_ms": min(m["tpot_ms"] for m in measured)}
        print(
            f"| {label} | {f['weights_bytes'] / MIB:.0f} | {f['kv_cache_bytes'] / MIB:.1f} "
            f"| {f['rss_delta_bytes'] / MIB:.0f} | {f['peak_rss_delta_bytes'] / MIB:.0f} "
            f"| {f['tpot_ms']:.0f} | {f['load_s']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    # One configuration, in a child process (see run_all).
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--kv", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--weight-quant", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--pruning", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
