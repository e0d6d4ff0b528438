"""Overload over loopback, with every request accounted for.

Method: start the real stack (embedded redis-server, every service, one node agent) on
free ports, deploy a tiny Llama (tp=1, pp=1) with a queue of ``--queue`` waiting requests,
then let ``--clients`` client threads send ``--requests`` requests each, back to back:
every third a priority one, every fourth with a deadline. Each request asks for
``--tokens`` tokens, ignoring EOS. Bounded: each call has a timeout and the count is fixed.

Printed: what the requests ended with (tokens, or which status), throughput, TTFT
medians and p99 by priority, and the checks of issue 17: nothing lost (every request got
its tokens or an explicit status), the client's tally equal to the scheduler's Prometheus
counters exactly (requests by ending, and tokens), and the devices' reserved bytes back to
their starting value once the deployment is removed.

Run: .venv/bin/python bench/load_test.py [--clients 16] [--requests 25] [--tokens 16] [--queue 8]
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import run_load, scheduler_counts  # noqa: E402
from services.api import common_pb2 as common  # noqa: E402
from services.api import deployment_service_pb2 as deploy_pb  # noqa: E402
from services.api import deployment_service_pb2_grpc, model_service_pb2_grpc  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.cli import stack as launcher  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402


def scrape(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def reserved(deployer) -> dict[str, int]:
    state = deployer.GetClusterState(deploy_pb.GetClusterStateRequest())
    return {
        f"{d.ref.node_id}/{d.ref.device_id}": d.reserved_bytes for n in state.nodes for d in n.devices
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=25, help="requests per client")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--queue", type=int, default=8, help="ISERVE_QUEUE_CAPACITY")
    args = parser.parse_args()

    print("starting the stack ...", file=sys.stderr)
    env = {
        "ISERVE_DEVICES": "2",
        "ISERVE_DEVICE_MEMORY_GIB": "2",
        "ISERVE_QUEUE_CAPACITY": str(args.queue),
    }
    with launcher.temporary_stack(env) as settings:
        create_checkpoint(
            settings.models_root / "load-tiny",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
        )
        models = model_service_pb2_grpc.ModelServiceStub(
            grpc.insecure_channel(settings.address("model"))
        )
        models.RegisterModel(
            model_pb.RegisterModelRequest(
                model_id="load-tiny", checkpoint_path="load-tiny", skip_profiling=True
            )
        )
        deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
            grpc.insecure_channel(settings.address("deploy"))
        )
        before = reserved(deployer)
        dep = deployer.Deploy(
            deploy_pb.DeployRequest(
                model_id="load-tiny",
                config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
            ),
            timeout=180,
        ).deployment
        print(f"deployed {dep.deployment_id} (batch {dep.config.batch_size}, queue {args.queue})")
        address = settings.address("scheduler")
        result = run_load(
            lambda: grpc.insecure_channel(address),
            {"deployment_id": dep.deployment_id},
            clients=args.clients,
            per_client=args.requests,
            max_tokens=args.tokens,
        )
        counted = scheduler_counts(scrape(settings.metrics_address("scheduler")), dep.deployment_id)
        deployer.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
        )
        after = reserved(deployer)

    codes = result.by_code()
    total = sum(codes.values())
    ok = codes.get("OK", 0)
    print(
        f"{total} requests from {args.clients} clients in {result.wall_s:.1f} s: "
        + ", ".join(f"{code} {n}" for code, n in sorted(codes.items()))
    )
    print(
        f"throughput: {ok / result.wall_s:.1f} completed requests/s, {result.tokens / result.wall_s:.0f} tokens/s"
    )
    for priority in (True, False):
        ttft = result.ttft_ms(priority)
        if ttft:
            print(
                f"TTFT {'priority' if priority else 'normal  '}: median {ttft[0]:.1f} ms, p99 {ttft[1]:.1f} ms"
            )
    tokens = counted.pop("tokens", 0.0)
    reconciled = counted == {c: float(n) for c, n in codes.items()} and tokens == result.tokens
    print(
        f"lost (no tokens and no explicit status): {len(result.lost)}: {'OK' if not result.lost else 'FAILED'}"
    )
    print(
        f"scheduler's counters {dict(sorted(counted.items()))}, tokens {tokens:.0f} against the clients' "
        f"{result.tokens}: {'reconciled exactly' if reconciled else 'MISMATCH'}"
    )
    print(
        f"reserved bytes before {before}, after removal {after}: {'OK' if before == after else 'LEAKED'}"
    )
    return 0 if reconciled and not result.lost and before == after else 1


if __name__ == "__main__":
    sys.exit(main())
