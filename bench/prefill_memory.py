"""Peak memory of one long prefill: the engine's causal attention against a built mask.

Method: a Llama-style checkpoint (hidden 256, 4 layers, 8 heads, 32,768 positions, float32)
written to a temporary directory; for each prompt length, a fresh Python process loads it
with the engine's own loader, sizes the KV cache for the prompt plus one token, and runs
one prefill of that many tokens from an empty cache (``Transformer.forward``, logits of
the last token only), in inference mode. The figure is the process's peak resident memory
(``ru_maxrss``) less its resident memory just before the prefill: what the pass adds.
"mask" runs the same pass through a boolean [T, T] mask built as the engine built it for
every prefill before (``positions``-based, handed to ``scaled_dot_product_attention``);
"causal" is the engine's path now (``is_causal``, no mask). Both run in this one
invocation, alternating, ``--repeats`` times; medians are printed. Last, "reserved": what
a deployment reserves for that prefill (``services.reservation.prefill_activation_bytes``)
against the causal pass's added memory less the KV cache it writes (the cache is
reserved on its own): the reservation must hold the pass.

Run: ``python bench/prefill_memory.py [--lengths 4096,8192,16384] [--repeats 3]`` (about
a minute on two cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20

_CHILD = """
import json, resource, sys, torch
sys.path.insert(0, {root!r})
from monitor_agent.engine.loader import load_model
path, tokens, mode = {path!r}, {tokens}, {mode!r}
torch.set_num_threads(2)
model = load_model(path)
model.setup_caches(1, tokens + 1)
if mode == "mask":
    def built(positions, kv_len):
        keys = torch.arange(kv_len)
        return (keys <= positions[:, :, None]).unsqueeze(1)
    model._attention_mask = built
ids = torch.randint(0, 256, (1, tokens))
positions = torch.arange(tokens).unsqueeze(0)
import psutil
before = psutil.Process().memory_info().rss
with torch.inference_mode():
    model(ids, positions, torch.tensor([0]), last_token_only=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"added": peak - before}}))
"""


def added_bytes(path: Path, tokens: int, mode: str) -> int:
    code = _CHILD.format(root=str(ROOT), path=str(path), tokens=tokens, mode=mode)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["added"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        print("note: an address-space limit is set; large prompts may fail", file=sys.stderr)

    from fingerprint_svc.registry import model_shape
    from services.api import common_pb2 as common
    from services.models.checkpoint import create_checkpoint, validate_checkpoint
    from services.reservation import prefill_activation_bytes

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long"
        create_checkpoint(
            path,
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            max_position_embeddings=32768,
        )
        checkpoint = validate_checkpoint(path)
        spec = checkpoint.spec
        shape = model_shape(spec, checkpoint.weight_bytes)
        config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1)
        print(
            "prompt tokens | added by the prefill, MiB: mask   causal | mask / causal |"
            " causal less KV, reserved MiB, reserved / it"
        )
        for tokens in lengths:
            runs: dict[str, list[int]] = {"mask": [], "causal": []}
            for _ in range(args.repeats):
                for mode in runs:
                    runs[mode].append(added_bytes(path, tokens, mode))
            mask, causal = (statistics.median(runs[m]) / MIB for m in ("mask", "causal"))
            kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * tokens * 4 / MIB
            reserved = prefill_activation_bytes(shape, config, tokens) / MIB
            print(
                f"{tokens:13d} | {mask:40.0f} {causal:8.0f} | {mask / max(causal, 1):12.1f}x |"
                f" {causal - kv:15.0f} {reserved:12.0f} {reserved / max(causal - kv, 1):14.2f}x"
            )


if __name__ == "__main__":
    main()
