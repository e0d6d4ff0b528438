"""Overload: 10x a deployment's capacity for 60 s; every request ends cleanly, and the
scheduler's memory stays flat.

Method. Start the real stack on loopback in a temporary state directory (as
``trace_replay.py`` does: embedded redis-server, every service, one node agent with 2
virtual CPU devices), create the small Llama of ``_stack_harness.MODEL_SHAPE`` and
register it (without fingerprint profiling unless ``--profile``: the scheduler then
learns the deployment's latency from traffic alone). Deploy it (tp=1, pp=1, ``--batch``
KV slots) with each policy of ``--policy`` (default both: EDF and FCFS, one deployment
each, same configuration, same TTFT SLO; ``--ttft-slo-ms`` defaults to
``--slo-multiple`` x the unloaded TTFT of a ``--max-input`` prompt). Every request has a
``--prompt-tokens`` prompt and asks for ``--output-tokens`` tokens (ignore_eos). The
capacity is measured once, on the first deployment: ``8 x batch`` requests closed-loop
with ``2 x batch`` in flight, completed requests per second.

Then for each policy in turn: a warm-up at 1x capacity for ``--warmup-s`` seconds, then
the scheduler's resident memory (psutil, the pid from the stack's ``stack.json``); then
``--multiple`` (10) x capacity for ``--duration-s`` (60) seconds, requests evenly spaced
and sent open-loop (one asyncio task and gRPC stream each, bounded by the count
rate x duration); after every request has ended, the resident memory again. Each request
must end with all its tokens, RESOURCE_EXHAUSTED (queue full) or DEADLINE_EXCEEDED (EDF's
refusal); any other status, a stream that ends short, and a request still open after the
per-request client timeout (``--timeout-s``, 120 s: counted as hung) is a failure.

Printed per policy and phase: sent, completed, each refusal code, failures and whether
sent == completed + RESOURCE_EXHAUSTED + DEADLINE_EXCEEDED holds exactly, the TTFT p50/p99
of completed requests, and the scheduler's resident memory after the warm-up and at the
end with their ratio (target: within 10 %). Exits 1 when a count does not reconcile or a
request hangs (the memory target is reported, MET or MISSED, but does not set the exit
status).

Run: .venv/bin/python bench/overload.py [--duration-s 60] [--multiple 10]
     [--policy both|edf|fcfs] [--warmup-s 10] [--timeout-s 120]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import _stack_harness as harness
import psutil

MIB = 1024 * 1024
MEMORY_TOLERANCE = 0.10
# Lets the scheduler finish the streams' bookkeeping before its memory is read.
SETTLE_S = 2.0


def evenly(rate_per_s: float, seconds: float, prompt: int, output: int) -> list[harness.Job]:
    """``rate_per_s x seconds`` requests, one every ``1 / rate_per_s`` seconds."""
    return [harness.Job(i / rate_per_s, prompt, output) for i in range(int(rate_per_s * seconds))]


def phase(
    address: str, served: harness.Served, jobs: list[harness.Job], timeout_s: float, salt: int
) -> harness.Tally:
    """Send ``jobs`` open-loop; print and return how they ended."""
    started = time.monotonic()
    outcomes = asyncio.run(harness.replay(address, served, jobs, timeout_s, salt))
    counted = harness.tally(jobs, outcomes)
    done = [o.ttft_ms for o, j in zip(outcomes, jobs, strict=True) if harness.completed(o, j)]
    hung = counted.codes[harness.HUNG]
    print(f"    {counted.line()}; hung {hung}; took {time.monotonic() - started:.1f} s")
    print(
        f"    TTFT of completed p50 {harness.percentile(done, 0.5):.0f} ms, "
        f"p99 {harness.percentile(done, 0.99):.0f} ms"
    )
    return counted


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=("both", *harness.POLICIES), default="both")
    parser.add_argument("--multiple", type=float, default=10.0, help="x measured capacity")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=10.0, help="at 1x capacity")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per-request client timeout")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo-ms", type=int, default=0, help="0: slo-multiple x unloaded")
    parser.add_argument("--slo-multiple", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="profile the model on register")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    policies = ["edf", "fcfs"] if args.policy == "both" else [args.policy]
    failures = 0
    memory_lines = []
    with harness.running_stack() as settings:
        register_s = harness.register_model(settings, profile=args.profile)
        served, slo_ms, unloaded = harness.deploy_policies(
            settings,
            policies,
            harness.Limits(args.batch, args.max_input, args.max_output),
            args.ttft_slo_ms,
            args.slo_multiple,
        )
        address = settings.address("scheduler")
        probe = [harness.Job(0.0, args.prompt_tokens, args.output_tokens)] * (8 * args.batch)
        capacity = harness.capacity_per_s(address, served[policies[0]], probe)
        scheduler = psutil.Process(harness.scheduler_pid(settings))
        rate = args.multiple * capacity
        print(
            f"model {harness.MODEL_SHAPE} registered in {register_s:.0f} s "
            f"({'profiled' if args.profile else 'no profiling'}); tp=1 pp=1 batch {args.batch}; "
            f"requests {args.prompt_tokens} prompt + {args.output_tokens} output tokens; "
            f"unloaded TTFT at {args.max_input} prompt tokens {unloaded:.0f} ms, TTFT SLO "
            f"{slo_ms} ms; capacity {capacity:.2f} req/s; overload {args.multiple:g}x = "
            f"{rate:.1f} req/s for {args.duration_s:g} s; scheduler pid {scheduler.pid}"
        )
        for index, policy in enumerate(policies):
            salt = index * 10**7
            print(f"\n{policy}:")
            print(f"  warm-up, 1x capacity for {args.warmup_s:g} s")
            warm = evenly(capacity, args.warmup_s, args.prompt_tokens, args.output_tokens)
            counts = [phase(address, served[policy], warm, args.timeout_s, salt)]
            time.sleep(SETTLE_S)
            before = scheduler.memory_info().rss
            print(f"  overload, {args.multiple:g}x capacity for {args.duration_s:g} s")
            heavy = evenly(rate, args.duration_s, args.prompt_tokens, args.output_tokens)
            counts.append(phase(address, served[policy], heavy, args.timeout_s, salt + 10**6))
            time.sleep(SETTLE_S)
            after = scheduler.memory_info().rss
            failures += sum(c.failed for c in counts)
            ratio = after / before
            met = abs(ratio - 1) <= MEMORY_TOLERANCE
            memory_lines.append(
                f"{policy}: scheduler RSS after warm-up {before / MIB:.1f} MiB, at the end "
                f"{after / MIB:.1f} MiB, ratio {ratio:.3f} (target within "
                f"{MEMORY_TOLERANCE:.0%}): {'MET' if met else 'MISSED'}"
            )
    print()
    for line in memory_lines:
        print(line)
    print(
        f"every request completed or refused with RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED, "
        f"none hung: {'yes' if failures == 0 else f'NO ({failures} failures)'}"
    )
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
