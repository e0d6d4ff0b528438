"""iserve's PyTorch engine against transformers' ``generate`` on the same checkpoint.

Method: write a random-weight Llama checkpoint (shape below; the same file for both),
load it in iserve's engine and in ``LlamaForCausalLM`` (fp32), set the same torch thread
count for both, and run greedy generation of N tokens from the same prompt, EOS
ignored (iserve: ``ignore_eos``; transformers: no ``eos_token_id``, so no extra logits
processor), alternating the two engines over R repetitions after the same two warm-up
runs each. transformers keeps its default cache. TTFT is call start to the first token;
TPOT is the mean gap between later tokens (transformers' tokens are timed through a
streamer that only takes a timestamp, iserve's as its generator yields, detokenised
text included). We print medians and the TPOT ratio (target: iserve at least 1.5x
faster), then iserve's throughput with continuous batching at batch 1, 4 and 16 (B
requests submitted at once, tokens/s over the whole run).

The shapes. "tiny" (3.3M parameters) is where the target is judged: serving a small
model on CPU is bound by per-token framework overhead, which is what an engine can
save. "small" (158M, a 32k vocabulary) is bound by reading ~0.5 GB of float32 weights a
token from memory, the same bytes for both engines at batch 1, so its ratio stays near
1x; it is reported to show that, not as a target.

Run: .venv/bin/python bench/engine_vs_transformers.py [--shape tiny|small|both] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from monitor_agent.engine.batching import GenerationRequest  # noqa: E402
from monitor_agent.engine.engine import Engine, SamplingConfig  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402

SHAPES = {
    # A small model where per-token framework overhead matters.
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4),
    # A Llama-style model with a real 32k vocabulary, where matmuls dominate.
    "small": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, vocab_size=32000),
}
PROMPT = "The quick brown fox jumps over the lazy dog because it wants to"


def time_stream(stream) -> tuple[float, float]:
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in stream]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return (stamps[0] - start) * 1e3, statistics.fmean(gaps) * 1e3


class _Stamps:
    """A transformers streamer that timestamps each generated token."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def hf_run(model, input_ids, tokens: int) -> tuple[float, float]:
    streamer = _Stamps()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=tokens,
            # No EOS, so no early stop, as iserve's ignore_eos. min_new_tokens would do
            # the same through a logits processor that costs transformers ~0.2 ms a token.
            eos_token_id=None,
            do_sample=False,
            streamer=streamer,
            pad_token_id=0,
        )
    s = streamer.stamps
    assert len(s) == tokens, f"transformers generated {len(s)} tokens, not {tokens}"
    gaps = [b - a for a, b in zip(s, s[1:], strict=False)]
    return (s[0] - start) * 1e3, statistics.fmean(gaps) * 1e3


def throughput(engine: Engine, prompt_ids: list[int], batch: int, tokens: int) -> float:
    sampling = SamplingConfig(ignore_eos=True)
    handles = [
        engine.batch.submit(GenerationRequest(tuple(prompt_ids), tokens, sampling))
        for _ in range(batch)
    ]
    start = time.perf_counter()
    produced = 0
    while engine.batch.has_work:
        produced += len(engine.batch.step())
    elapsed = time.perf_counter() - start
    assert produced == batch * tokens and all(h.generated == tokens for h in handles)
    return produced / elapsed


def bench_shape(name: str, args) -> None:
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="iserve-bench-") as tmp:
        path = create_checkpoint(Path(tmp) / name, **SHAPES[name])
        torch.set_num_threads(args.threads)
        engine = Engine(path, max_seq_len=256, max_batch=16, num_threads=args.threads)
        hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompt_ids = engine.encode(PROMPT)
        input_ids = torch.tensor([prompt_ids])
        sampling = SamplingConfig(ignore_eos=True)

        def iserve_run():
            return time_stream(engine.generate(prompt_ids, args.tokens, sampling))

        for _ in range(2):
            iserve_run()
            hf_run(hf, input_ids, args.tokens)
        runs = {"iserve": [], "transformers": []}
        for i in range(args.repeats):
            order = [
                ("iserve", iserve_run),
                ("transformers", lambda: hf_run(hf, input_ids, args.tokens)),
            ]
            for label, fn in order if i % 2 == 0 else reversed(order):
                runs[label].append(fn())
        med = {
            k: (statistics.median(t for t, _ in v), statistics.median(p for _, p in v))
            for k, v in runs.items()
        }
        params = sum(p.numel() for p in hf.parameters()) / 1e6
        print(
            f"\n## shape {name}: {SHAPES[name]} ({params:.1f}M parameters, fp32), {args.threads} thread(s), "
            f"{len(prompt_ids)}-token prompt, {args.tokens} new tokens, {args.repeats} repetitions (medians)"
        )
        print(f"{'engine':<14}{'TTFT ms':>10}{'TPOT ms':>10}")
        for k, (ttft, tpot) in med.items():
            print(f"{k:<14}{ttft:>10.2f}{tpot:>10.3f}")
        ratio = med["transformers"][1] / med["iserve"][1]
        print(
            f"TPOT speed-up of iserve over transformers: {ratio:.2f}x (target >= 1.5x): "
            f"{'OK' if ratio >= 1.5 else 'MISSED'}"
        )
        for batch in (1, 4, 16):
            rates = [throughput(engine, prompt_ids, batch, args.tokens) for _ in range(3)]
            print(
                f"iserve continuous batching, batch {batch:>2}: {statistics.median(rates):8.0f} tokens/s"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for name in SHAPES if args.shape == "both" else [args.shape]:
        bench_shape(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
