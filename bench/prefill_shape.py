"""Prefill's shape beyond the profiled prompts: ``a + b (n + k n^2)`` with the layer's own
weights in ``k = H / P``, against a gated MLP's count, for three MLP forms.

Method: for each family (Llama: gated MLP; Falcon, multi-query, and GPT-J: plain
two-matrix MLPs), a random checkpoint (``--hidden``, 4 layers, 4 heads, float32) is
loaded with the engine's own loader in this process (two threads), and one prefill of
each of ``--lengths`` tokens is timed from an empty cache (``Transformer.forward``, last
token's logits), ``--repeats`` rounds over the lengths, medians printed. The line
``a + b (n + k n^2)`` through the two shortest lengths (the profiler's longest two
prompts, 256 and 1,024 tokens, by default) predicts the longer ones, with ``k``:

  layer   ``H / P``, ``P`` the decoder layer's weights as the checkpoint counts them
          (the estimator's own ``k``, from the registered record's shape);
  gated   ``P`` counted as if the MLP were gated (three matrices), what it assumed for
          every family before.

Error: prediction / measured - 1. For Llama the two are the same (a control).

Run: ``python bench/prefill_shape.py [--hidden 256] [--lengths 256,1024,4096,8192]
[--repeats 3]`` (about a minute at hidden 256 on two cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fingerprint_svc.registry import model_shape  # noqa: E402
from monitor_agent.engine.loader import load_model  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.estimation.model_references import _attention_share  # noqa: E402
from services.estimation.profiles import estimation_shape  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from services.models.families import parse_config  # noqa: E402

FAMILIES = (("llama", 2), ("falcon", 1), ("gptj", None))  # (arch, KV heads)


def shares(path: Path) -> tuple[float, float]:
    """(k from the layer's own weights, k from a gated MLP's count), as the estimator
    computes them from the registered record's shape."""
    spec = parse_config(json.loads((path / "config.json").read_text()))
    record = model_pb.Model(model_id=path.name, shape=model_shape(spec, spec.weight_bytes()))
    shape = estimation_shape(record)
    as_gated = dataclasses.replace(shape, layer_weights=0)
    return _attention_share(shape), _attention_share(as_gated)


def prefill_seconds(path: Path, lengths: list[int], repeats: int) -> dict[int, float]:
    model = load_model(str(path))
    times: dict[int, list[float]] = {n: [] for n in lengths}
    with torch.inference_mode():
        for _ in range(repeats):
            for n in lengths:
                model.setup_caches(1, n + 1)
                ids = torch.randint(0, 256, (1, n))
                positions = torch.arange(n).unsqueeze(0)
                start = torch.tensor([0])
                model(ids[:, :16], positions[:, :16], start, last_token_only=True)  # warm
                began = time.perf_counter()
                model(ids, positions, start, last_token_only=True)
                times[n].append(time.perf_counter() - began)
    return {n: statistics.median(v) for n, v in times.items()}


def predicted(measured: dict[int, float], k: float, low: int, high: int, n: int) -> float:
    def shape(x: int) -> float:
        return x + k * x * x

    b = (measured[high] - measured[low]) / (shape(high) - shape(low))
    return measured[high] + b * (shape(n) - shape(high))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lengths", default="256,1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if len(lengths) < 3:
        parser.error("--lengths needs two to fit and at least one to predict")
    low, high, beyond = lengths[0], lengths[1], lengths[2:]
    torch.set_num_threads(2)
    print(f"hidden {args.hidden}, 4 layers, float32; fitted on {low} and {high} tokens")
    print("family   k(layer)  k(gated) | measured ms: " + " ".join(f"{n:>6}" for n in lengths))
    with tempfile.TemporaryDirectory() as tmp:
        for arch, kv_heads in FAMILIES:
            path = create_checkpoint(
                Path(tmp) / arch,
                arch=arch,
                hidden_size=args.hidden,
                num_layers=4,
                num_heads=4,
                num_kv_heads=kv_heads,
                max_position_embeddings=max(lengths) + 1,
            )
            k_layer, k_gated = shares(path)
            measured = prefill_seconds(path, lengths, args.repeats)
            row = f"{arch:7s} {k_layer:9.2e} {k_gated:9.2e} |              "
            row += " ".join(f"{measured[n] * 1e3:6.0f}" for n in lengths)
            for name, k in (("layer", k_layer), ("gated", k_gated)):
                errors = (predicted(measured, k, low, high, n) / measured[n] - 1 for n in beyond)
                row += f" | {name}: " + " ".join(f"{e:+6.1%}" for e in errors)
            print(row, flush=True)


if __name__ == "__main__":
    main()
