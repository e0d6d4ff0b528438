"""What the scheduler path adds to a generation, against calling the worker directly.

Method: start the real stack (embedded redis-server, every service, one node agent) in
a temporary state directory on free ports, create a tiny Llama checkpoint, register and
deploy it (tp=1, pp=1), then send N requests through InferenceService.Generate and N
straight to the deployment's WorkerService.Generate, alternating between the two so
that drift on this noisy machine hits both alike. The stack runs as `iserve up` runs it:
with 2 virtual devices on this 2-core machine the worker is pinned to one core and the
control plane (the scheduler included) is not pinned at all.

The measuring client stands in for a remote caller, so by default it is pinned to the
cores the worker does not own (``--no-pin-client`` leaves it free). Left free on 2
cores, it is often woken on the worker's core while the engine computes the next token
and waits there: an artefact of sharing 2 cores that adds ~0.5 ms to the scheduler
path's TTFT (traced: scheduler sends the first token -> client receives it) and almost
nothing to the direct path, whose sender is the worker itself.

Every request is greedy, ignores EOS and asks for the same number of tokens. Per request
we take the client-side TTFT (call start -> first token) and TPOT (mean gap between later
tokens). We print the medians of each path and their differences: the overhead. A third
path, a do-nothing pass-through proxy (``bench/bare_proxy.py``, a new worker call per
request) measured in the same interleaved run, shows what a plain Python gRPC hop costs
on this machine. Targets: <= 1 ms TTFT and <= 0.1 ms per token added.

With ``--auth`` the stack runs with ISERVE_AUTH=on: the client sends the admin token, the
scheduler checks it in Redis on each call and sends the service token to the worker,
which checks it too; run it without and with to see what authentication adds.

Run: .venv/bin/python bench/serving_overhead.py [--requests 200] [--tokens 32] [--no-pin-client] [--auth]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import transport  # noqa: E402
from services.api import agent_service_pb2 as agent_pb  # noqa: E402
from services.api import (
    agent_service_pb2_grpc,  # noqa: E402
    deployment_service_pb2_grpc,  # noqa: E402
    inference_service_pb2_grpc,  # noqa: E402
    model_service_pb2_grpc,  # noqa: E402
    worker_service_pb2_grpc,  # noqa: E402
)
from services.api import common_pb2 as common  # noqa: E402
from services.api import deployment_service_pb2 as deploy_pb  # noqa: E402
from services.api import inference_service_pb2 as infer_pb  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.api import worker_service_pb2 as worker_pb  # noqa: E402
from services.cli import stack as launcher  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402


def timed(stream) -> tuple[float, float, int]:
    """(TTFT ms, mean inter-token gap ms, tokens) of one streamed call."""
    start = time.perf_counter()
    stamps = []
    for message in stream:
        ids = (
            message.delta.token_ids
            if isinstance(message, infer_pb.GenerateResponse)
            else message.token_ids
        )
        if len(ids):
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return (stamps[0] - start) * 1e3, statistics.fmean(gaps) * 1e3 if gaps else 0.0, len(stamps)


def pin_off_worker(agent_channel: grpc.Channel, deployment_id: str) -> str:
    """Pin this process to the cores the deployment's worker does not own; returns them
    as text ("all" when the worker owns every core, and then nothing is pinned)."""
    agent = agent_service_pb2_grpc.AgentServiceStub(agent_channel)
    workers = agent.ListWorkers(agent_pb.ListWorkersRequest(deployment_id=deployment_id)).workers
    worker_cores = set().union(*(os.sched_getaffinity(w.pid) for w in workers))
    free = os.sched_getaffinity(0) - worker_cores
    if not free:
        return "all"
    # Every thread, gRPC's own included: pid 0 would pin only the calling thread.
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), free)
    return ",".join(map(str, sorted(free)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per path (default 200)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--no-pin-client",
        dest="pin_client",
        action="store_false",
        help="leave the measuring client free to run on the worker's cores",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=2,
        help="virtual CPU devices; each owns a share of the cores (default 2: the worker gets one core)",
    )
    parser.add_argument(
        "--auth", action="store_true", help="run the stack with ISERVE_AUTH=on (tokens checked)"
    )
    args = parser.parse_args()

    print("starting the stack ...", file=sys.stderr)
    with launcher.temporary_stack(
        {
            "ISERVE_DEVICES": str(args.devices),
            "ISERVE_DEVICE_MEMORY_GIB": "2",
            "ISERVE_AUTH": "on" if args.auth else "off",
        }
    ) as settings:
        # The admin token with --auth (the CLI's, from the stack's state directory); the
        # worker wants the service token.
        client = transport.Transport.for_client(settings)
        as_service = transport.Transport.for_service(settings)
        create_checkpoint(
            settings.models_root / "bench-tiny",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
        )
        models = model_service_pb2_grpc.ModelServiceStub(
            client.sync_channel(settings.address("model"))
        )
        models.RegisterModel(
            model_pb.RegisterModelRequest(
                model_id="bench-tiny", checkpoint_path="bench-tiny", skip_profiling=True
            )
        )
        deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
            client.sync_channel(settings.address("deploy"))
        )
        dep = deployer.Deploy(
            deploy_pb.DeployRequest(
                model_id="bench-tiny",
                config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
            ),
            timeout=180,
        ).deployment
        scheduler = inference_service_pb2_grpc.InferenceServiceStub(
            client.sync_channel(settings.address("scheduler"))
        )
        worker = worker_service_pb2_grpc.WorkerServiceStub(
            as_service.sync_channel(dep.worker_address)
        )
        sampling = common.SamplingParams(ignore_eos=True)
        prompt = "The scheduler should add almost nothing"

        def via_scheduler():
            return timed(
                scheduler.Generate(
                    infer_pb.GenerateRequest(
                        deployment_id=dep.deployment_id,
                        prompt=prompt,
                        max_tokens=args.tokens,
                        sampling=sampling,
                    )
                )
            )

        proxy = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("bare_proxy.py")),
                dep.worker_address,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "ISERVE_TOKEN": settings.service_token},
        )
        client_cores = "all"
        if args.pin_client:
            client_cores = pin_off_worker(
                as_service.sync_channel(settings.address("agent")), dep.deployment_id
            )
        bare = inference_service_pb2_grpc.InferenceServiceStub(
            grpc.insecure_channel(f"127.0.0.1:{proxy.stdout.readline().strip()}")
        )

        def via_bare_proxy():
            return timed(
                bare.Generate(
                    infer_pb.GenerateRequest(
                        prompt=prompt, max_tokens=args.tokens, sampling=sampling
                    )
                )
            )

        def direct():
            return timed(
                worker.Generate(
                    worker_pb.WorkerServiceGenerateRequest(
                        prompt=prompt, max_tokens=args.tokens, sampling=sampling
                    )
                )
            )

        paths = [
            ("direct", direct),
            ("scheduler", via_scheduler),
            ("bare proxy", via_bare_proxy),
        ]
        for _ in range(args.warmup):
            for _name, fn in paths:
                fn()
        runs = {name: [] for name, _ in paths}
        for i in range(args.requests):
            # Rotate the order so that no path always runs first.
            for name, fn in paths[i % 3 :] + paths[: i % 3]:
                ttft, tpot, n = fn()
                assert n == args.tokens, f"{name} streamed {n} tokens, expected {args.tokens}"
                runs[name].append((ttft, tpot))
        proxy.kill()
        deployer.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
        )

    med = {
        name: (statistics.median(t for t, _ in r), statistics.median(p for _, p in r))
        for name, r in runs.items()
    }
    print(f"authentication {'on (tokens checked on both hops)' if args.auth else 'off'}")
    print(
        f"{args.devices} virtual CPU devices on {os.cpu_count()} cores (the worker is pinned to "
        f"one device's cores); measuring client on cores: {client_cores}"
    )
    d_ttft = med["scheduler"][0] - med["direct"][0]
    d_tpot = med["scheduler"][1] - med["direct"][1]
    print(
        f"serving overhead: {args.requests} requests per path, {args.tokens} tokens each, tiny Llama "
        "(hidden 64, 2 layers), greedy; client-side timings, medians"
    )
    print(f"{'path':<12}{'TTFT ms':>10}{'TPOT ms':>10}")
    for name in runs:
        print(f"{name:<12}{med[name][0]:>10.3f}{med[name][1]:>10.4f}")
    print(
        f"a bare pass-through proxy adds {med['bare proxy'][0] - med['direct'][0]:+.3f} ms TTFT and "
        f"{med['bare proxy'][1] - med['direct'][1]:+.4f} ms per token (a plain Python gRPC hop, a new worker call per request)"
    )
    print(f"added TTFT {d_ttft:+.3f} ms (target <= 1 ms): {'OK' if d_ttft <= 1.0 else 'MISSED'}")
    print(
        f"added per token {d_tpot:+.4f} ms (target <= 0.1 ms): {'OK' if d_tpot <= 0.1 else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
