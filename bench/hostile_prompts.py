"""Hostile prompts: one client's huge text prompts beside others' short ones.

A tester sent text prompts of 300k-500k characters (within the worker's cheap bound on
characters, so each was encoded before its refusal) while others sent short text
prompts: the short prompts' TTFT went from 16 ms to 1.1 s with two such senders and
3.9 s with six, and afterwards an idle EDF deployment refused ordinary requests (its
prefill model had learnt the encoding queue as prefill).

Method. Start the real stack on loopback (``_stack_harness.running_stack``: embedded
redis-server, every service, one agent with 2 virtual CPU devices), create and register
the small Llama of ``_stack_harness.MODEL_SHAPE`` without profiling, and deploy it once
(tp=1, pp=1, batch 4, EDF, TTFT SLO ``--ttft-slo-ms``, max 512 prompt + 128 output
tokens: the worker holds 640 positions, whose cheap bound lets through texts up to
about 327k characters). Then, for each count of hostile senders in ``--senders``
(default 0, 2, 6; 0 is the peer every other row is read against), for ``--phase-s``
seconds:

- each hostile sender sends, back to back, a text of ``--hostile-chars`` characters
  (CJK, about a token a character), each of which must end INVALID_ARGUMENT;
- one measuring client sends a short text prompt (a sentence, about 12 tokens, 4 output
  tokens) every 0.25 s, and records its client-side TTFT.

Printed per row: the short prompts' TTFT p50 and p90 and how they ended, the hostile
prompts sent and how they ended. After the rows, on the idle deployment: ``--after``
ordinary requests of a text prompt of about 400 tokens (within the limit), sent one at a time, and
how they ended (each should be served: a DEADLINE_EXCEEDED here is the learnt-queue
defect), then one text prompt guessed far over the limit, whose answer should be the
worker's INVALID_ARGUMENT, not DEADLINE_EXCEEDED.

Run: .venv/bin/python bench/hostile_prompts.py [--senders 0,2,6] [--phase-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import _stack_harness as harness
import grpc

from services.api import common_pb2 as common
from services.api import inference_service_pb2 as infer_pb
from services.api import inference_service_pb2_grpc

SHORT_PROMPT = "The river runs past the old mill, and under the stone bridge."
HOSTILE_TEXT = "東京は日本の首都です。川は古い水車小屋のそばを流れる。"
ORDINARY_TEXT = SHORT_PROMPT + " "
SHORT_EVERY_S = 0.25


async def generate(
    stub: inference_service_pb2_grpc.InferenceServiceStub,
    deployment_id: str,
    prompt: str,
    max_tokens: int,
    timeout_s: float = 60.0,
) -> tuple[str, float]:
    """(how the request ended: OK or a status name, client-side TTFT in ms or NaN)."""
    sent = time.perf_counter()
    first = None
    try:
        async for message in stub.Generate(
            infer_pb.GenerateRequest(
                deployment_id=deployment_id,
                prompt=prompt,
                max_tokens=max_tokens,
                sampling=common.SamplingParams(ignore_eos=True),
            ),
            timeout=timeout_s,
        ):
            if first is None and message.HasField("delta") and message.delta.token_ids:
                first = time.perf_counter()
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, float("nan")
    return "OK", (first - sent) * 1e3 if first is not None else float("nan")


async def phase(address: str, deployment_id: str, senders: int, args) -> None:
    hostile = (HOSTILE_TEXT * (args.hostile_chars // len(HOSTILE_TEXT) + 1))[: args.hostile_chars]
    end = time.perf_counter() + args.phase_s
    short: list[tuple[str, float]] = []
    refused: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_service_pb2_grpc.InferenceServiceStub(channel)

        async def sender() -> None:
            while time.perf_counter() < end:
                code, _ = await generate(stub, deployment_id, hostile, 4)
                refused[code] += 1

        async def measuring() -> None:
            while time.perf_counter() < end:
                started = time.perf_counter()
                short.append(await generate(stub, deployment_id, SHORT_PROMPT, 4))
                await asyncio.sleep(max(0.0, started + SHORT_EVERY_S - time.perf_counter()))

        await asyncio.gather(measuring(), *(sender() for _ in range(senders)))
    ttfts = [t for code, t in short if code == "OK"]
    ended = Counter(code for code, _ in short)
    print(
        f"{senders:>7} | {harness.percentile(ttfts, 0.5):8.0f} {harness.percentile(ttfts, 0.9):8.0f}"
        f" | {dict(ended)} | {sum(refused.values())} sent: {dict(refused)}",
        flush=True,
    )


async def after(address: str, deployment_id: str, count: int) -> None:
    ordinary = ORDINARY_TEXT * 16  # about 400 tokens with this model's tokenizer
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
        results = [await generate(stub, deployment_id, ordinary, 4) for _ in range(count)]
        ended = Counter(code for code, _ in results)
        ttfts = [t for code, t in results if code == "OK"]
        print(
            f"\nidle deployment afterwards: {count} ordinary requests ({len(ordinary)} characters "
            f"of text): {dict(ended)}; TTFT median {harness.percentile(ttfts, 0.5):.0f} ms"
        )
        code, _ = await generate(stub, deployment_id, ORDINARY_TEXT * 500, 4)
        print(
            f"a text prompt guessed over the limit ({len(ORDINARY_TEXT) * 500} characters): {code}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", default="0,2,6", help="hostile sender counts, one row each")
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--hostile-chars", type=int, default=300_000)
    parser.add_argument("--ttft-slo-ms", type=int, default=2000)
    parser.add_argument("--after", type=int, default=5)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    with harness.running_stack() as settings:
        harness.register_model(settings, profile=False)
        served = harness.deploy(settings, "edf", harness.Limits(4, 512, 128), args.ttft_slo_ms)
        address = settings.address("scheduler")
        print(
            f"model {harness.MODEL_SHAPE}; tp=1 pp=1 batch 4, EDF, TTFT SLO {args.ttft_slo_ms} ms; "
            f"hostile prompts of {args.hostile_chars} characters; a short prompt every "
            f"{SHORT_EVERY_S} s for {args.phase_s:g} s a row\n"
        )
        print("senders | short TTFT p50      p90 ms | short ended | hostile")
        for senders in [int(s) for s in args.senders.split(",")]:
            asyncio.run(phase(address, served.deployment_id, senders, args))
        asyncio.run(after(address, served.deployment_id, args.after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
