"""TPOT of one request under tensor/pipeline parallelism on CPU cores, real workers.

Method: writes a random Llama-style checkpoint, then for each layout starts its ranks as
``python -m monitor_agent.worker`` processes (rank r pinned to core r mod the cores
given, one thread each unless a layout says otherwise), streams ``--tokens`` greedy
tokens ``--repeats`` times through rank 0's WorkerService after one warm-up request and
prints the median of the worker's own TPOT (mean time between tokens after the first).
Layouts: tp=1 on one core, tp=1 on two cores (intra-op threads), tp=2 and pp=2 on two
cores. Layouts of more than one rank run once per ``--collectives`` transport (the step's
messages over shared memory, the default, or over gloo's TCP; ``ISERVE_CPU_COLLECTIVES``,
see monitor_agent/engine/shm_collectives.py), and the bench prints the ratio between the
two. On a machine shared with other work the figures move; compare within one run.

    .venv/bin/python bench/parallel_tpot.py --hidden 1024 --layers 8 --tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

from services.api import common_pb2 as common  # noqa: E402
from services.api import worker_service_pb2 as worker_pb  # noqa: E402
from services.api import worker_service_pb2_grpc  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from services.ports import free_port  # noqa: E402

# name: (tp, pp, cores of each rank)
LAYOUTS = {
    "tp1 (1 core)": (1, 1, ["0"]),
    "tp1 (2 cores)": (1, 1, ["0,1"]),
    "tp2": (2, 1, ["0", "1"]),
    "pp2": (1, 2, ["0", "1"]),
}


def start(
    checkpoint: Path, layers: int, tp: int, pp: int, cores: list[str], run: Path, transport: str
):
    world = tp * pp
    rendezvous = f"127.0.0.1:{free_port()}"
    per_stage = layers // pp
    procs = []
    for rank in range(world):
        stage = rank // tp
        argv = [
            sys.executable, "-m", "monitor_agent.worker", "--deployment-id", "bench",
            "--rank", str(rank), "--world-size", str(world),
            "--tensor-parallel", str(tp), "--pipeline-parallel", str(pp),
            "--checkpoint", str(checkpoint), "--max-seq-len", "256",
            "--cores", cores[rank], "--ready-file", str(run / f"ready-{rank}.json"),
            "--log-level", "WARNING",
        ]  # fmt: skip
        if world > 1:
            argv += ["--rendezvous", rendezvous]
        if pp > 1:
            argv += ["--first-layer", str(stage * per_stage), "--layer-count", str(per_stage)]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(len(cores[rank].split(","))),
            "ISERVE_CPU_COLLECTIVES": transport,
        }
        procs.append(subprocess.Popen(argv, env=env, cwd=PROJECT_ROOT))
    deadline = time.monotonic() + 180
    while not all((run / f"ready-{r}.json").exists() for r in range(world)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("workers did not start")
        time.sleep(0.1)
    port = json.loads((run / "ready-0.json").read_text())["port"]
    return procs, f"127.0.0.1:{port}"


def tpot_ms(address: str, tokens: int) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        request = worker_pb.WorkerServiceGenerateRequest(
            request_id="bench",
            prompt_token_ids=list(range(1, 33)),
            max_tokens=tokens,
            sampling=common.SamplingParams(ignore_eos=True),
        )
        *_, last = stub.Generate(request, timeout=600)
    return last.timings.tpot_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS), metavar="LAYOUT"
    )
    parser.add_argument(
        "--collectives",
        nargs="+",
        choices=("shm", "gloo"),
        default=["shm", "gloo"],
        help="transports for layouts of several ranks (default: both, compared)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = create_checkpoint(
            Path(tmp) / "ckpt",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.heads // 2,
        )
        print(
            f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, float32; "
            f"{args.tokens} tokens after a 32-token prompt, median of {args.repeats}"
        )
        for name in args.layouts:
            tp, pp, cores = LAYOUTS[name]
            medians = {}
            for transport in args.collectives if tp * pp > 1 else ["-"]:
                run = Path(tmp) / f"{name.replace(' ', '_')}-{transport}"
                run.mkdir()
                procs, address = start(checkpoint, args.layers, tp, pp, cores, run, transport)
                try:
                    tpot_ms(address, 4)  # warm-up
                    samples = [tpot_ms(address, args.tokens) for _ in range(args.repeats)]
                finally:
                    for proc in procs:
                        proc.terminate()
                    for proc in procs:
                        proc.wait(30)
                medians[transport] = statistics.median(samples)
                label = name if transport == "-" else f"{name} ({transport})"
                rounded = [round(x, 2) for x in samples]
                print(f"{label:>20}: TPOT {medians[transport]:7.2f} ms  (samples {rounded})")
            if "shm" in medians and "gloo" in medians:
                ratio = medians["gloo"] / medians["shm"]
                print(f"{name:>20}: gloo / shared memory {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
