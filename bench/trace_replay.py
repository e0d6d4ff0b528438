"""SLO attainment of EDF against FCFS, replaying the Azure LLM inference traces (2023).

Method. Start the real stack (embedded redis-server, every service, one node agent with
2 virtual CPU devices; the worker is pinned to one core, the control plane and this
client share the machine) in a temporary state directory on loopback ports. Create a
small Llama checkpoint (``_stack_harness.MODEL_SHAPE``: hidden 512, 6 layers, random
weights), register it (fingerprint profiling on, so each deployment starts with its own
latency estimate; ``--skip-profiling`` leaves the scheduler to learn it from traffic),
and deploy it twice with the same explicit configuration (tp=1, pp=1, ``--batch`` KV
slots, ``--max-input``/``--max-output`` tokens) on the same virtual device: once FCFS,
once EDF, both with the same TTFT SLO. Only one of them gets traffic at a time.

The TTFT SLO (``--ttft-slo-ms``) defaults to ``--slo-multiple`` (10) x the unloaded
TTFT of a prompt of ``--max-input`` tokens (median of 5 sequential requests), rounded
up to 50 ms: the longest prefill the deployment can be asked for, with room for a few
requests' worth of queueing.

Each trace (``AzureLLMInferenceTrace_code.csv`` and ``_conv.csv``, columns TIMESTAMP,
ContextTokens, GeneratedTokens; ``--traces-dir``, default ``../shared/data/
azure-llm-traces`` next to the repository) is reduced to a window of ``--requests``
consecutive requests at a start drawn with ``--seed``. Token counts are scaled by one
factor per column and trace, mapping the trace's 99th percentile to the deployment's
max_input / max_output (so relative sizes are kept; rounded, clamped to 1..max; the
longest 1 % are clamped). The deployment's capacity is measured per trace: the window's
requests sent closed-loop with 2 x batch in flight on the FCFS deployment, completed
requests per second; every other policy's deployment takes the same closed-loop traffic
(not measured), so that none meets the measured runs cold. For each load factor (0.5x, 1x, 2x capacity) the window's
inter-arrival gaps are multiplied by one constant so that the mean rate is
factor x capacity (the trace's burstiness stays; it is not made Poisson). With
``--rate-basis peak`` the rate of its busiest tenth is set instead (``traces.peak_rate``:
both rates spread requests that share a timestamp evenly over one step of the
timestamps' resolution, so whole-second traces such as BurstGPT have a finite peak rate
too, and 30 a second read as 30). The
requests are sent open-loop at those times (one asyncio task per request, a gRPC stream
each, ``prompt_token_ids`` of the scaled length, ``ignore_eos`` so every output has the
scaled length) to each policy's deployment in turn (the order alternates per repeat).

Per run: SLO attainment (requests completed with all their tokens and a client-side
TTFT within the SLO, over requests sent), goodput (those requests per second of the
run's makespan: first send to last reply), throughput (output tokens of completed
requests per second of makespan), TTFT p50/p95/p99 and TPOT p50/p95 of completed
requests (client side: send -> first token, mean gap after it), refusals by status
code, and the check sent == completed + refused (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED);
the bench exits 1 when a run does not reconcile. With ``--repeats`` > 1 the figures are
medians over repeats. Targets (the issue's): at 2x, EDF attainment / FCFS attainment
>= 1.3 on both traces; at 0.5x both policies >= 95 %.

Other traces: ``--trace PATH`` (repeatable) reads any file ``bench/traces.py`` reads
(the Azure 2024 week-long traces, BurstGPT, Mooncake with ``--time-unit ms``), beside
or instead of (``--traces ''``) the two above. Results are named by file name, so two
files with one name are refused. A window without two distinct arrival times has no rate
to scale; it is refused before the stack starts, as are a trace file that cannot be read,
bad load factors and other out-of-range numbers (``--repeats 0``, ``--batch 0``, ...).

Run: .venv/bin/python bench/trace_replay.py [--requests 200] [--traces code,conv]
     [--trace PATH ...] [--factors 0.5,1,2] [--repeats 1] [--ttft-slo-ms N]
     [--skip-profiling]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from pathlib import Path

import _stack_harness as harness  # puts the repository on sys.path
from traces import RATE_BASES, TIME_UNITS, TraceRow, load_trace, mean_rate, peak_rate

from services.cli.arguments import positive_number, whole_number

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = REPO.parent / "shared" / "data" / "azure-llm-traces"
TRACE_FILE = "AzureLLMInferenceTrace_{}.csv"
# Token counts at this quantile of the trace map to the deployment's limits.
SCALE_QUANTILE = 0.99


def scaler(values: list[int], limit: int):
    """Maps a trace's token count to 1..limit, its SCALE_QUANTILE going to ``limit``."""
    factor = limit / max(1.0, harness.percentile(values, SCALE_QUANTILE))
    return lambda n: min(limit, max(1, round(n * factor)))


def window_jobs(
    rows: list[TraceRow], count: int, seed: int, max_input: int, max_output: int
) -> list[harness.Job]:
    """``count`` consecutive rows from a seeded start, token counts scaled, arrivals
    relative to the window's first (unscaled seconds)."""
    scale_in = scaler([r.context_tokens for r in rows], max_input)
    scale_out = scaler([r.generated_tokens for r in rows], max_output)
    window = _window_rows(rows, count, seed)
    t0 = window[0].arrival_s
    return [
        harness.Job(r.arrival_s - t0, scale_in(r.context_tokens), scale_out(r.generated_tokens))
        for r in window
    ]


def arrivals(jobs: list[harness.Job]) -> list[float]:
    """The jobs' send times, in seconds: what ``traces``' rates measure."""
    return [j.at_s for j in jobs]


def at_rate(jobs: list[harness.Job], rate_per_s: float, basis: str) -> list[harness.Job]:
    """The same jobs with every arrival multiplied by one constant, so that their
    ``basis`` rate (a key of ``traces.RATE_BASES``: "mean", or "peak", see
    ``traces.peak_rate``) is ``rate_per_s``. The jobs have two distinct arrival times and
    ``rate_per_s`` is positive (:func:`windows` and :func:`parse_args` check)."""
    stretch = RATE_BASES[basis](arrivals(jobs)) / rate_per_s
    return [harness.Job(j.at_s * stretch, j.prompt_tokens, j.output_tokens) for j in jobs]


def run_figures(
    jobs: list[harness.Job], outcomes: list[harness.Outcome], slo_ms: float
) -> dict[str, float]:
    """Attainment, goodput, throughput and latency percentiles of one run."""
    done = [(o, j) for o, j in zip(outcomes, jobs, strict=True) if harness.completed(o, j)]
    met = sum(o.ttft_ms <= slo_ms for o, _ in done)
    makespan = max(o.done_at_s for o in outcomes) - min(o.sent_at_s for o in outcomes)
    ttfts = [o.ttft_ms for o, _ in done]
    tpots = [o.tpot_ms for o, _ in done]
    return {
        "attainment": met / len(jobs),
        "goodput": met / makespan,
        "throughput": sum(j.output_tokens for _, j in done) / makespan,
        "ttft_p50": harness.percentile(ttfts, 0.5),
        "ttft_p95": harness.percentile(ttfts, 0.95),
        "ttft_p99": harness.percentile(ttfts, 0.99),
        "tpot_p50": harness.percentile(tpots, 0.5),
        "tpot_p95": harness.percentile(tpots, 0.95),
    }


def print_run(label: str, figures: dict[str, float], tally: harness.Tally, example: str) -> None:
    """One run's figures, its reconciliation and one refusal's message (``example``)."""
    print(
        f"  {label:<22} attain {figures['attainment']:6.1%}  goodput {figures['goodput']:6.2f} req/s"
        f"  tput {figures['throughput']:7.1f} tok/s  TTFT p50/p95/p99 {figures['ttft_p50']:6.0f}/"
        f"{figures['ttft_p95']:6.0f}/{figures['ttft_p99']:6.0f} ms"
        f"  TPOT p50/p95 {figures['tpot_p50']:5.1f}/{figures['tpot_p95']:5.1f} ms"
    )
    print(f"  {'':<22} {tally.line()}")
    if example:
        print(f"  {'':<22} e.g. {example}")


def load_factors(text: str) -> list[float]:
    """``--factors``: comma-separated multiples of capacity, each positive and finite."""
    try:
        factors = [float(f) for f in text.split(",")]
    except ValueError:
        factors = []
    if not factors or not all(math.isfinite(f) and f > 0 for f in factors):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive numbers (0.5,1,2)")
    return factors


def window_size(text: str) -> int:
    """``--requests``: at least two, since one request has no arrival rate."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: a window needs at least 2 requests")
    return count


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES)
    parser.add_argument(
        "--traces",
        default="code,conv",
        help="comma-separated names of AzureLLMInferenceTrace_NAME.csv in --traces-dir "
        "(code,conv); empty with --trace",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="any other trace file (Azure 2023/2024, BurstGPT CSV, Mooncake JSON lines; "
        "see bench/traces.py), named by its file name; repeatable",
    )
    parser.add_argument(
        "--time-unit",
        choices=sorted(TIME_UNITS),
        default="s",
        help="unit of numeric timestamps in --trace files (Mooncake's are ms)",
    )
    parser.add_argument(
        "--requests", type=window_size, default=200, help="requests per run window (>= 2)"
    )
    parser.add_argument(
        "--factors", type=load_factors, default="0.5,1,2", help="load factors x capacity"
    )
    parser.add_argument(
        "--repeats", type=whole_number(1), default=1, help="runs per point (median)"
    )
    parser.add_argument("--seed", type=int, default=0, help="picks each trace's window")
    parser.add_argument(
        "--rate-basis",
        choices=sorted(RATE_BASES),
        default="mean",
        help="which rate the load factor sets: the window's mean, or its busiest tenth's",
    )
    parser.add_argument(
        "--ttft-slo-ms", type=whole_number(0), default=0, help="0: slo-multiple x unloaded"
    )
    parser.add_argument("--slo-multiple", type=positive_number, default=10.0)
    parser.add_argument(
        "--batch", type=whole_number(1), default=8, help="KV slots of each deployment"
    )
    parser.add_argument("--max-input", type=whole_number(1), default=512)
    parser.add_argument("--max-output", type=whole_number(1), default=128)
    parser.add_argument(
        "--timeout-s", type=positive_number, default=120.0, help="per-request client timeout"
    )
    parser.add_argument("--skip-profiling", action="store_true")
    return parser.parse_args()


def read_traces(args: argparse.Namespace) -> dict[str, list[TraceRow]]:
    """Every trace to replay, by the name its results carry. SystemExit for none, for a
    name two files share, or for a file ``load_trace`` refuses."""
    sources = [
        (name, args.traces_dir / TRACE_FILE.format(name), "s")
        for name in filter(None, args.traces.split(","))
    ]
    sources += [(path.name, path, args.time_unit) for path in args.trace]
    if not sources:
        raise SystemExit("no trace to replay: give --traces names or --trace files")
    traces: dict[str, list[TraceRow]] = {}
    paths: dict[str, Path] = {}
    for name, path, time_unit in sources:
        if name in paths:
            raise SystemExit(
                f"two traces are named {name} ({paths[name]} and {path}); results are named "
                "by file name, so rename one"
            )
        paths[name] = path
        try:
            traces[name] = load_trace(path, time_unit)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    return traces


def windows(
    traces: dict[str, list[TraceRow]], args: argparse.Namespace
) -> dict[str, list[harness.Job]]:
    """Each trace's window (:func:`window_jobs`). SystemExit for a window whose rate cannot
    be measured (fewer than two distinct arrival times), before anything is started."""
    chosen = {}
    for name, rows in traces.items():
        window = window_jobs(rows, args.requests, args.seed, args.max_input, args.max_output)
        try:
            peak_rate(arrivals(window))
        except ValueError as exc:
            raise SystemExit(
                f"trace {name}: the window of {len(window)} of its {len(rows)} requests "
                f"(--requests {args.requests}, --seed {args.seed}) {exc}"
            ) from None
        chosen[name] = window
        taken = _window_rows(rows, args.requests, args.seed)
        empty = sum(1 for r in taken if not r.context_tokens)
        silent = sum(1 for r in taken if not r.generated_tokens)
        if empty or silent:
            # Replayed as one token (a request needs a prompt and produces a token).
            print(
                f"trace {name}: {empty} prompt(s) and {silent} output(s) of 0 tokens in the "
                "window are replayed as 1 token",
                file=sys.stderr,
            )
    return chosen


def _window_rows(rows: list[TraceRow], count: int, seed: int) -> list[TraceRow]:
    """``count`` consecutive rows from a start drawn with ``seed`` (0..len(rows) -
    count: each whole window in the trace; 0 for a short trace)."""
    start = random.Random(seed).randrange(max(0, len(rows) - count) + 1)
    return rows[start : start + count]


def main() -> int:
    args = parse_args()
    factors = args.factors
    traces = read_traces(args)
    replayed = windows(traces, args)
    results: dict[tuple[str, float, str], list[dict[str, float]]] = {}
    reconciled = True
    started = time.monotonic()
    with harness.running_stack() as settings:
        register_s = harness.register_model(settings, profile=not args.skip_profiling)
        served, slo_ms, unloaded = harness.deploy_policies(
            settings,
            list(harness.POLICIES),
            harness.Limits(args.batch, args.max_input, args.max_output),
            args.ttft_slo_ms,
            args.slo_multiple,
        )
        address = settings.address("scheduler")
        print(
            f"model {harness.MODEL_SHAPE} registered in {register_s:.0f} s "
            f"({'no profiling' if args.skip_profiling else 'profiled'}); deployments tp=1 pp=1 "
            f"batch {args.batch}, max_input {args.max_input}, max_output {args.max_output}; "
            f"unloaded TTFT at {args.max_input} prompt tokens {unloaded:.1f} ms; "
            f"TTFT SLO {slo_ms} ms"
        )
        for name, window in replayed.items():
            capacity = harness.capacity_per_s(address, served["fcfs"], window)
            for policy, deployment in served.items():
                if policy != "fcfs":
                    # The same closed-loop traffic first: FCFS met the measured runs warm
                    # (workers, the scheduler's predictor), EDF cold, and its first run
                    # attained 63 % where later ones attained 80-83 % (a tester).
                    harness.capacity_per_s(address, deployment, window)
            print(
                f"\ntrace {name}: {len(traces[name])} rows, window of {len(window)} spanning "
                f"{window[-1].at_s:.1f} s ({mean_rate(arrivals(window)):.2f} req/s); "
                "scaled prompt mean "
                f"{sum(j.prompt_tokens for j in window) / len(window):.0f} tokens, output mean "
                f"{sum(j.output_tokens for j in window) / len(window):.1f} tokens; "
                f"capacity {capacity:.2f} req/s"
            )
            for factor in factors:
                jobs = at_rate(window, factor * capacity, args.rate_basis)
                print(
                    f"  {factor:g}x: mean {mean_rate(arrivals(jobs)):.2f} req/s, busiest tenth "
                    f"{peak_rate(arrivals(jobs)):.2f} req/s "
                    f"({args.rate_basis} = {factor:g} x capacity)"
                )
                for repeat in range(args.repeats):
                    order = list(harness.POLICIES)[:: 1 if repeat % 2 == 0 else -1]
                    for policy in order:
                        outcomes = asyncio.run(
                            harness.replay(address, served[policy], jobs, args.timeout_s)
                        )
                        tally = harness.tally(jobs, outcomes)
                        figures = run_figures(jobs, outcomes, slo_ms)
                        reconciled &= tally.reconciles
                        key = (name, factor, policy)
                        results.setdefault(key, []).append(figures)
                        refused = [o.detail for o in outcomes if o.code in harness.REFUSALS]
                        label = f"{factor:g}x {policy} #{repeat + 1}"
                        print_run(
                            label, figures, tally, refused[len(refused) // 2] if refused else ""
                        )
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    return report(results, factors, list(traces), slo_ms, args.repeats, reconciled)


def report(results, factors, traces, slo_ms, repeats, reconciled) -> int:
    """Print the summary table and the targets; the exit status."""
    med = {
        key: {m: harness.median([run[m] for run in runs]) for m in runs[0]}
        for key, runs in results.items()
    }
    print(
        f"\nsummary (TTFT SLO {slo_ms} ms; {'median of ' + str(repeats) if repeats > 1 else 'one run'} "
        "per point; client-side TTFT)"
    )
    print(
        f"{'trace':<6}{'load':>6}{'FCFS att':>10}{'EDF att':>9}{'EDF/FCFS':>10}"
        f"{'FCFS good':>11}{'EDF good':>10}{'FCFS p99':>10}{'EDF p99':>9}"
    )
    for trace in traces:
        for factor in factors:
            fcfs, edf = med[(trace, factor, "fcfs")], med[(trace, factor, "edf")]
            ratio = edf["attainment"] / fcfs["attainment"] if fcfs["attainment"] else math.inf
            print(
                f"{trace:<6}{factor:>5g}x{fcfs['attainment']:>10.1%}{edf['attainment']:>9.1%}"
                f"{ratio:>10.2f}{fcfs['goodput']:>11.2f}{edf['goodput']:>10.2f}"
                f"{fcfs['ttft_p99']:>10.0f}{edf['ttft_p99']:>9.0f}"
            )
    verdicts = []
    if 2.0 in factors:
        for trace in traces:
            fcfs, edf = med[(trace, 2.0, "fcfs")], med[(trace, 2.0, "edf")]
            ratio = edf["attainment"] / fcfs["attainment"] if fcfs["attainment"] else math.inf
            verdicts.append((f"2x {trace}: EDF/FCFS attainment {ratio:.2f} >= 1.3", ratio >= 1.3))
    if 0.5 in factors:
        for trace in traces:
            for policy in harness.POLICIES:
                attained = med[(trace, 0.5, policy)]["attainment"]
                verdicts.append((f"0.5x {trace} {policy}: {attained:.1%} >= 95%", attained >= 0.95))
    for text, met in verdicts:
        print(f"target {text}: {'MET' if met else 'MISSED'}")
    print(f"every run reconciles (sent == completed + refused): {'yes' if reconciled else 'NO'}")
    return 0 if reconciled else 1


if __name__ == "__main__":
    sys.exit(main())
