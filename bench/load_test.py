"""Overload from several clients with mixed priorities and deadlines, every request
accounted for (issue 17's load test; ``overload.py`` is the open-loop, 10x-capacity one).

Method: start the real stack on loopback (``_stack_harness.running_stack``: embedded
redis-server, every service, one agent with 2 virtual CPU devices) with a queue of
``--queue`` waiting requests per deployment, register the harness's small Llama, deploy
it with EDF (tp=1, pp=1, ``--batch`` KV slots) and note every device's reserved bytes
before. Then ``--clients`` clients, each with its own channel, send ``--requests``
requests each back to back, all at once: every third a priority one, every fourth with
``--deadline-ms``; each a ``--prompt-tokens`` prompt asking ``--tokens`` tokens (ignore_eos).
Bounded: a fixed count, and a client timeout per request (``--timeout-s``).

Printed: how the requests ended, throughput, TTFT medians and p99 by priority, and the
checks: nothing lost (each request has its tokens or RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED),
the clients' tally equal to the scheduler's Prometheus counters exactly (requests by
ending, and tokens), and the reserved bytes back to their starting value once the
deployment is removed. Exits 1 when a check fails.

Run: .venv/bin/python bench/load_test.py [--clients 16] [--requests 25] [--tokens 16]
     [--queue 8] [--batch 4] [--deadline-ms 300]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _stack_harness as h  # noqa: E402
from services.api import deployment_service_pb2 as deploy_pb  # noqa: E402
from services.api import deployment_service_pb2_grpc  # noqa: E402


def scrape(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def reserved(settings) -> dict[str, int]:
    deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
        grpc.insecure_channel(settings.address("deploy"))
    )
    state = deployer.GetClusterState(deploy_pb.GetClusterStateRequest())
    return {
        f"{d.ref.node_id}/{d.ref.device_id}": d.reserved_bytes
        for n in state.nodes
        for d in n.devices
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=25, help="requests per client")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--queue", type=int, default=8, help="ISERVE_QUEUE_CAPACITY")
    parser.add_argument("--batch", type=int, default=4, help="KV slots of the deployment")
    parser.add_argument("--deadline-ms", type=int, default=300)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()

    with h.running_stack(queue_capacity=args.queue) as settings:
        h.register_model(settings, profile=False)
        before = reserved(settings)
        limits = h.Limits(args.batch, max(64, args.prompt_tokens), max(64, args.tokens))
        served = h.deploy(settings, "edf", limits, ttft_slo_ms=0)
        print(
            f"deployed {served.deployment_id} (EDF, batch {served.batch_size}, queue {args.queue})"
        )
        per_client = h.mixed_jobs(
            args.clients, args.requests, args.prompt_tokens, args.tokens, args.deadline_ms
        )
        outcomes, seconds = asyncio.run(
            h.clients_closed_loop(settings.address("scheduler"), served, per_client, args.timeout_s)
        )
        counted = h.scheduler_counts(
            scrape(settings.metrics_address("scheduler")), served.deployment_id
        )
        h.remove(settings, served)
        after = reserved(settings)

    jobs = [job for jobs in per_client for job in jobs]
    tally = h.tally(jobs, outcomes)
    print(f"{tally.sent} requests from {args.clients} clients in {seconds:.1f} s: {tally.line()}")
    tokens = sum(o.tokens for o in outcomes)
    print(
        f"throughput: {tally.completed / seconds:.1f} completed requests/s, {tokens / seconds:.0f} tokens/s"
    )
    for priority in (True, False):
        ttfts = [
            o.ttft_ms
            for o, j in zip(outcomes, jobs, strict=True)
            if j.priority == priority and h.completed(o, j)
        ]
        print(
            f"TTFT {'priority' if priority else 'normal  '} ({len(ttfts)} completed): "
            f"median {h.median(ttfts):.1f} ms, p99 {h.percentile(ttfts, 0.99):.1f} ms"
        )
    client_codes = {code: float(n) for code, n in tally.codes.items()}
    scheduler_tokens = counted.pop("tokens", 0.0)
    reconciled = counted == client_codes and scheduler_tokens == tokens
    print(
        f"scheduler's counters {dict(sorted(counted.items()))}, tokens {scheduler_tokens:.0f}; clients "
        f"{dict(sorted(client_codes.items()))}, tokens {tokens}: "
        f"{'reconciled exactly' if reconciled else 'MISMATCH'}"
    )
    print(
        f"reserved bytes before {before}, after removal {after}: {'OK' if before == after else 'LEAKED'}"
    )
    return 0 if reconciled and tally.reconciles and before == after else 1


if __name__ == "__main__":
    sys.exit(main())
