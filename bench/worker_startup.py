"""Worker start-up, stop and decode speed: fresh processes against the warm worker pool.

Method: a real redis-server (embedded) and the agent's real ``WorkerSupervisor``; a
2-layer Llama-style checkpoint (hidden 512, like a fingerprint of the CPU bench's models) on one virtual CPU device. Each round starts
one worker (``start_workers``: process start, imports, model load, kernel self-checks,
gRPC server up, ready file) and stops it (``stop_workers``: SIGTERM, exit), once as
``python -m monitor_agent.worker`` (``subprocess``, what every worker was before the
pool) and once forked from the warm pool (``monitor_agent.worker_pool``), alternating,
``--rounds`` times. Each ready worker also serves four requests (a 64-token prompt, 32
greedy tokens, EOS ignored; the first untimed, the medians of the others kept) so that the bench shows a forked worker decodes as fast as a
fresh one: the worker's own TTFT and TPOT. Prints the median and the spread of each.

``--device cuda`` runs the worker on the first GPU (found through NVML) in bfloat16 instead.

Run: ``python bench/worker_startup.py [--rounds 7] [--device cpu|cuda]`` (about a minute
on two cores).
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

import grpc  # noqa: E402

from monitor_agent.devices import DeviceSpec, cuda_devices, host_cores, virtual_devices  # noqa: E402
from monitor_agent.launch import LaunchPlan, WorkerPlan  # noqa: E402
from monitor_agent.supervisor import WorkerSupervisor  # noqa: E402
from monitor_agent.worker_pool import WorkerPool  # noqa: E402
from services.api import common_pb2 as common_pb  # noqa: E402
from services.api import worker_service_pb2 as worker_pb  # noqa: E402
from services.api import worker_service_pb2_grpc as worker_grpc  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from services.redis_embedded import start_redis  # noqa: E402
from services.state.store import StateStore  # noqa: E402

TIMED_REQUESTS = 3


def bench_device(kind: str) -> DeviceSpec:
    """One virtual CPU device on core 0, or the first GPU."""
    if kind == "cpu":
        return virtual_devices(1, 1 << 30, [0], "x86_64")[0]
    found = cuda_devices(host_cores())
    if not found:
        raise SystemExit("--device cuda: NVML finds no GPU (is nvidia-ml-py installed?)")
    return found[0]


async def one_round(supervisor: WorkerSupervisor, checkpoint: Path, name: str, device):
    plan = LaunchPlan(
        deployment_id=name,
        checkpoint_dir=checkpoint,
        dtype="bfloat16" if device.is_cuda else "float32",
        max_seq_len=256,
        max_batch=1,
        tensor_parallel=1,
        pipeline_parallel=1,
        workers=(WorkerPlan(0, device),),
        ready_timeout_s=120.0,
    )
    started = time.perf_counter()
    [info] = await supervisor.start_workers(plan)
    ready = time.perf_counter()
    ttft_ms, tpot_ms = await generate(info.address)
    stopping = time.perf_counter()
    await supervisor.stop_workers(name)
    return ready - started, time.perf_counter() - stopping, ttft_ms, tpot_ms


async def generate(address: str):
    """The worker's own TTFT and TPOT (ms), medians of TIMED_REQUESTS greedy requests
    after an untimed one."""
    request = worker_pb.WorkerServiceGenerateRequest(
        request_id="bench",
        prompt_token_ids=[5 + i % 200 for i in range(64)],
        max_tokens=32,
        sampling=common_pb.SamplingParams(temperature=0.0, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_grpc.WorkerServiceStub(channel)
        timings = []
        for _ in range(1 + TIMED_REQUESTS):  # the first is a warm-up
            replies = [reply async for reply in stub.Generate(request)]
            timings.append(replies[-1].timings)
    return (
        statistics.median(t.ttft_ms for t in timings[1:]),
        statistics.median(t.tpot_ms for t in timings[1:]),
    )


async def run(rounds: int, root: Path, redis_url: str, device) -> dict[str, list[tuple]]:
    checkpoint = create_checkpoint(root / "ckpt", hidden_size=512, num_layers=2, num_heads=8)
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
    times: dict[str, list[tuple]] = {mode: [] for mode in supervisors}
    try:
        for mode, supervisor in supervisors.items():  # warm-up: page cache, the server
            await one_round(supervisor, checkpoint, f"warm-{mode}", device)
        for i in range(rounds):
            for mode, supervisor in supervisors.items():
                times[mode].append(await one_round(supervisor, checkpoint, f"{mode}-{i}", device))
    finally:
        for supervisor in supervisors.values():
            await supervisor.stop_all()
        await store.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    device = bench_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        redis, url = start_redis(Path(tmp) / "redis", appendonly=False)
        try:
            times = asyncio.run(run(args.rounds, Path(tmp), url, device))
        finally:
            redis.kill()
            redis.wait()
    print(
        f"worker start-up, stop (s) and its requests' TTFT, TPOT (ms) on {device.name}; "
        f"{args.rounds} rounds each, median (min-max)"
    )
    medians = {}
    for mode, rows in times.items():
        cells = []
        for i, (label, unit) in enumerate(
            (("ready", "s"), ("stopped", "s"), ("TTFT", "ms"), ("TPOT", "ms"))
        ):
            values = [r[i] for r in rows]
            cells.append(
                f"{label} {statistics.median(values):.3f} {unit} ({min(values):.3f}-{max(values):.3f})"
            )
        medians[mode] = statistics.median(r[0] for r in rows)
        print(f"  {mode:5s}  " + "   ".join(cells))
    print(f"  start-up: pool is {medians['fresh'] / medians['pool']:.1f}x faster than fresh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
