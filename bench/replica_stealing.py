"""Requests waiting on one replica while another frees early: the scheduler's queues with
and without moving waiting requests, on a real event loop.

Two replicas of one deployment (batch 1). Each request asks for ``--max-tokens`` tokens
and is routed by ``QueueRegistry.shortest_wait``, which prices it by its max_tokens; it
then generates a uniformly drawn number of tokens from 1 to max_tokens (it stops at its
end-of-sequence token), each taking ``--token-ms`` of real time (an ``asyncio.sleep``
stands for the worker). Arrivals are Poisson at ``--load`` of the two replicas' capacity
at the mean length. The peer in the same run is the same registry with
``move_waiting=False``: each request stays on the replica it was routed to. Each mode
runs ``--rounds`` times on the same arrivals per round; the figures are medians over
rounds of each round's median / p90 / p99 wait for a slot and time to the last token.

    .venv/bin/python bench/replica_stealing.py            # about 90 s
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from scheduler_svc.policies import QueueEntry
from scheduler_svc.queues import QueueRegistry
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb


def deployment(replicas: int, token_ms: float) -> deploy_pb.Deployment:
    dep = deploy_pb.Deployment(
        deployment_id="bench-0a1b2c3d",
        model_id="bench",
        state=deploy_pb.DEPLOYMENT_STATE_READY,
        config=common.DeploymentConfig(batch_size=1),
        max_input_tokens=512,
        latency_model=common.LatencyModel(decode_step_ms=token_ms),
    )
    for i in range(replicas):
        dep.replicas.add(
            index=i, worker_address=f"127.0.0.1:{5000 + i}", state=deploy_pb.DEPLOYMENT_STATE_READY
        )
    return dep


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_round(
    move: bool, arrivals: list[tuple[float, int]], args
) -> tuple[list[float], list[float]]:
    registry = QueueRegistry(capacity=10_000, move_waiting=move)
    dep = deployment(args.replicas, args.token_ms)
    registry.set_serving(dep)  # as the scheduler does at each admission
    waits: list[float] = []
    totals: list[float] = []

    async def request(i: int, tokens: int) -> None:
        arrived = time.perf_counter()
        _, index = registry.shortest_wait(dep)
        queue = registry.queue_for(dep, index)
        entry = QueueEntry(f"r{i}", arrived, prompt_tokens=1, max_tokens=args.max_tokens)
        holder = await queue.acquire(entry)
        waits.append(time.perf_counter() - arrived)
        try:
            await asyncio.sleep(tokens * args.token_ms / 1e3)
        finally:
            holder.release(entry)
        totals.append(time.perf_counter() - arrived)

    start = time.perf_counter()
    tasks = []
    for i, (at, tokens) in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(request(i, tokens)))
    await asyncio.gather(*tasks)
    return waits, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--token-ms", type=float, default=2.0)
    parser.add_argument("--load", type=float, default=0.8, help="of the replicas' capacity")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    mean_s = (1 + args.max_tokens) / 2 * args.token_ms / 1e3
    rate = args.load * args.replicas / mean_s
    print(
        f"{args.replicas} replicas, batch 1; {args.requests} requests, Poisson at {rate:.1f}/s "
        f"({args.load:.0%} of capacity); max_tokens {args.max_tokens}, 1-{args.max_tokens} "
        f"generated (uniform), {args.token_ms:g} ms a token; {args.rounds} rounds"
    )
    figures: dict[bool, list[tuple[float, ...]]] = {True: [], False: []}
    for r in range(args.rounds):
        rng = random.Random(args.seed + r)
        at, arrivals = 0.0, []
        for _ in range(args.requests):
            at += rng.expovariate(rate)
            arrivals.append((at, rng.randint(1, args.max_tokens)))
        for move in (False, True):  # the peer first, then the change, on the same arrivals
            waits, totals = asyncio.run(one_round(move, arrivals, args))
            figures[move].append(
                tuple(percentile(v, q) * 1e3 for v in (waits, totals) for q in (0.5, 0.9, 0.99))
            )
    print(
        "medians over rounds, ms: wait for a slot p50 / p90 / p99 | to last token p50 / p90 / p99"
    )
    for move, label in ((False, "stay where routed"), (True, "move waiting    ")):
        med = [statistics.median(f[i] for f in figures[move]) for i in range(6)]
        print(
            f"  {label}: {med[0]:6.1f} {med[1]:6.1f} {med[2]:6.1f} | "
            f"{med[3]:6.1f} {med[4]:6.1f} {med[5]:6.1f}"
        )
    stay = [statistics.median(f[i] for f in figures[False]) for i in (1, 2, 4, 5)]
    move = [statistics.median(f[i] for f in figures[True]) for i in (1, 2, 4, 5)]
    print(
        "ratio stay / move: wait p90 {:.2f}x, p99 {:.2f}x; last token p90 {:.2f}x, p99 {:.2f}x".format(
            *(s / m if m else float("nan") for s, m in zip(stay, move, strict=True))
        )
    )


if __name__ == "__main__":
    main()
