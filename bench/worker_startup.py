"""Worker start-up and stop: fresh processes against the warm worker pool.

Method: a real redis-server (embedded) and the agent's real ``WorkerSupervisor``; a
1-layer Llama-style checkpoint (hidden 256) on one virtual CPU device. Each round starts
one worker (``start_workers``: process start, imports, model load, kernel self-checks,
gRPC server up, ready file) and stops it (``stop_workers``: SIGTERM, exit), once as
``python -m monitor_agent.worker`` (``subprocess``, what every worker was before the
pool) and once forked from the warm pool (``monitor_agent.worker_pool``), alternating,
``--rounds`` times. Prints the median and the spread of each.

Run: ``python bench/worker_startup.py [--rounds 7]`` (about a minute on two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from monitor_agent.devices import virtual_devices  # noqa: E402
from monitor_agent.launch import LaunchPlan, WorkerPlan  # noqa: E402
from monitor_agent.supervisor import WorkerSupervisor  # noqa: E402
from monitor_agent.worker_pool import WorkerPool  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from services.redis_embedded import start_redis  # noqa: E402
from services.state.store import StateStore  # noqa: E402


async def one_round(supervisor: WorkerSupervisor, checkpoint: Path, name: str):
    device = virtual_devices(1, 1 << 30, [0], "x86_64")[0]
    plan = LaunchPlan(
        deployment_id=name,
        checkpoint_dir=checkpoint,
        dtype="float32",
        max_seq_len=256,
        max_batch=1,
        tensor_parallel=1,
        pipeline_parallel=1,
        workers=(WorkerPlan(0, device),),
        ready_timeout_s=120.0,
    )
    started = time.perf_counter()
    await supervisor.start_workers(plan)
    ready = time.perf_counter()
    await supervisor.stop_workers(name)
    return ready - started, time.perf_counter() - ready


async def run(rounds: int, root: Path, redis_url: str) -> dict[str, list[tuple[float, float]]]:
    checkpoint = create_checkpoint(root / "ckpt", hidden_size=256, num_layers=1, num_heads=4)
    store = StateStore.from_url(redis_url)
    pool = WorkerPool()
    pool.start()
    supervisors = {
        mode: WorkerSupervisor(
            node_id="bench",
            store=store,
            state_dir=root / mode,
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            pool=pool if mode == "pool" else None,
        )
        for mode in ("fresh", "pool")
    }
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in supervisors}
    try:
        for mode, supervisor in supervisors.items():  # warm-up: page cache, the server
            await one_round(supervisor, checkpoint, f"warm-{mode}")
        for i in range(rounds):
            for mode, supervisor in supervisors.items():
                times[mode].append(await one_round(supervisor, checkpoint, f"{mode}-{i}"))
    finally:
        for supervisor in supervisors.values():
            await supervisor.stop_all()
        await store.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        redis, url = start_redis(Path(tmp) / "redis", appendonly=False)
        try:
            times = asyncio.run(run(args.rounds, Path(tmp), url))
        finally:
            redis.kill()
            redis.wait()
    print(f"worker start-up and stop, {args.rounds} rounds each (median, min-max), seconds")
    medians = {}
    for mode, rows in times.items():
        start = [r[0] for r in rows]
        stop = [r[1] for r in rows]
        medians[mode] = statistics.median(start)
        print(
            f"  {mode:5s}  ready {statistics.median(start):6.3f} ({min(start):.3f}-{max(start):.3f})"
            f"   stopped {statistics.median(stop):6.3f} ({min(stop):.3f}-{max(stop):.3f})"
        )
    print(f"  start-up: pool is {medians['fresh'] / medians['pool']:.1f}x faster than fresh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
