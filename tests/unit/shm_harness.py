"""One rank of a shared-memory group, for tests of monitor_agent.engine.shm_collectives.

``python -m tests.unit.shm_harness --rank R --world W --rendezvous HOST:PORT --out DIR
--scenario NAME [--timeout-s S]`` joins a gloo group of W ranks (one stage, tp = W),
opens the shared group and runs the scenario, writing what it saw to
``DIR/<rank>.pt`` (tensors) or ``DIR/<rank>.json`` (errors and timings).

Scenarios:
  exchange  all-reduce of a multi-chunk float32 tensor, of a non-contiguous bfloat16 one
            and of an empty one; a multi-chunk broadcast from rank 0; a chain of sends
            0 -> 1 -> ... -> W-1 -> 0 of an odd byte count. Inputs are seeded by rank
            (see :func:`inputs`) so the test can compute the expected results.
  mismatch  rank 0 sends 100 floats, rank 1 receives 50.
  die       rank 1 leaves at once; rank 0 waits for a message from it.
  silent    rank 1 stays but sends nothing; rank 0 waits for a message from it.
  optout    only reports whether the shared group opened.
  die_in_setup  rank 1 leaves before the shared group is set up; rank 0 reports the
            error its setup raised.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def inputs(rank: int):
    """The tensors rank ``rank`` contributes in the exchange scenario."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return {
        "big": torch.randn(3, 100_003, generator=g),
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "broadcast": torch.randn(300_001, generator=g),
        "chain": torch.randint(0, 256, (700_001,), dtype=torch.uint8, generator=g),
    }


def exchange(group, rank: int, world: int) -> dict:
    import torch

    ranks = list(range(world))
    mine = inputs(rank)
    big = mine["big"].clone()
    group.all_reduce(big, ranks)
    bf16 = mine["bf16"].clone().t()  # non-contiguous
    group.all_reduce(bf16, ranks)
    empty = torch.empty(0, 5)
    group.all_reduce(empty, ranks)
    broadcast = mine["broadcast"].clone()
    group.broadcast(broadcast, 0, ranks)
    chain = torch.empty_like(mine["chain"])
    after, before = (rank + 1) % world, (rank - 1) % world
    if rank == 0:
        group.send(mine["chain"], after)
        group.recv(chain, before)
    else:
        group.recv(chain, before)
        group.send(mine["chain"], after)
    return {"big": big, "bf16": bf16.t().contiguous(), "broadcast": broadcast, "chain": chain}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args(argv)

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from monitor_agent.engine.shm_collectives import open_shared_group

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.rendezvous}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=60),
    )
    if args.scenario == "die_in_setup":
        if args.rank == 1:
            return 0  # gone before the group's shared file is mapped
        try:
            open_shared_group(args.rank, args.world, 1, args.timeout_s)
            failed = {"error": None}
        except RuntimeError as exc:
            failed = {"error": str(exc)}
        (args.out / f"{args.rank}.json").write_text(json.dumps(failed))
        return 0
    group = open_shared_group(args.rank, args.world, 1, args.timeout_s)
    report: dict = {"opened": group is not None}
    if args.scenario == "optout" or group is None:
        (args.out / f"{args.rank}.json").write_text(json.dumps(report))
        return 0
    if args.scenario == "exchange":
        torch.save(exchange(group, args.rank, args.world), args.out / f"{args.rank}.pt")
        return 0
    if args.rank == 1:
        if args.scenario == "mismatch":
            try:
                group.recv(torch.empty(50), 0)
            except RuntimeError as exc:
                report["error"] = str(exc)
        elif args.scenario == "die":
            return 0
        elif args.scenario == "silent":
            time.sleep(args.timeout_s * 4)
        (args.out / f"{args.rank}.json").write_text(json.dumps(report))
        return 0
    started = time.monotonic()
    try:
        if args.scenario == "mismatch":
            group.send(torch.zeros(100), 1)
        else:
            group.recv(torch.empty(10), 1)
    except RuntimeError as exc:
        report["error"] = str(exc)
    report["waited_s"] = time.monotonic() - started
    (args.out / f"{args.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    from tests.unit.parallel_harness import leave

    leave(main())
