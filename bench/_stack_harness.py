"""Shared by the scheduling benchmarks (``trace_replay.py``, ``overload.py``): a live stack
with one small CPU Llama, deployments with a scheduling policy and a TTFT SLO, an
open-loop asyncio client that records how each request ended, and the figures.

Not a benchmark itself. Every address is loopback (``temporary_stack`` binds 127.0.0.1
on free ports); every loop is bounded by a request count or a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.api import common_pb2 as common  # noqa: E402
from services.api import deployment_service_pb2 as deploy_pb  # noqa: E402
from services.api import (  # noqa: E402
    deployment_service_pb2_grpc,
    inference_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import inference_service_pb2 as infer_pb  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.cli import stack as launcher  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from services.settings import Settings, read_stack_file  # noqa: E402

MODEL_ID = "bench-sched"
# A Llama small enough that one CPU core runs a few hundred trace requests a minute, big
# enough that prefill grows visibly with the prompt (so prompt length matters to EDF).
MODEL_SHAPE = {
    "hidden_size": 512,
    "num_layers": 6,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1376,
    "vocab_size": 4096,
    "max_position_embeddings": 1024,
}
POLICIES = {"fcfs": common.SCHEDULING_POLICY_FCFS, "edf": common.SCHEDULING_POLICY_EDF}
# Codes a refused request may end with; anything else is a failure.
REFUSALS = ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
OK = "OK"
DEPLOY_ATTEMPTS = 3
SLO_ROUNDING_MS = 50
HUNG = "HUNG"


@dataclass(frozen=True)
class Served:
    """A live deployment the benches send to."""

    deployment_id: str
    policy: str
    ttft_slo_ms: int
    batch_size: int
    max_input_tokens: int
    max_output_tokens: int


@contextlib.contextmanager
def running_stack(
    devices: int = 2, device_memory_gib: float = 2.0, queue_capacity: int | None = None
) -> Iterator[Settings]:
    """The real stack (embedded Redis, every service, one agent) in a temporary directory
    on loopback, as ``serving_overhead.py`` starts it; stopped on exit."""
    print("starting the stack ...", file=sys.stderr)
    env = {"ISERVE_DEVICES": str(devices), "ISERVE_DEVICE_MEMORY_GIB": str(device_memory_gib)}
    if queue_capacity is not None:
        env["ISERVE_QUEUE_CAPACITY"] = str(queue_capacity)
    with launcher.temporary_stack(env) as settings:
        yield settings


def register_model(settings: Settings, *, profile: bool) -> float:
    """Create the checkpoint and register it (profiling its fingerprints when ``profile``);
    returns the seconds registration took."""
    create_checkpoint(settings.models_root / MODEL_ID, **MODEL_SHAPE)
    models = model_service_pb2_grpc.ModelServiceStub(
        grpc.insecure_channel(settings.address("model"))
    )
    start = time.monotonic()
    models.RegisterModel(
        model_pb.RegisterModelRequest(
            model_id=MODEL_ID, checkpoint_path=MODEL_ID, skip_profiling=not profile
        ),
        timeout=60,
    )
    deadline = start + 900
    while profile and time.monotonic() < deadline:
        model = models.GetModel(model_pb.GetModelRequest(model_id=MODEL_ID), timeout=10).model
        if model.state == model_pb.MODEL_STATE_PROFILED:
            break
        if model.state == model_pb.MODEL_STATE_FAILED:
            raise RuntimeError(f"profiling {MODEL_ID} failed: {model.state_reason}")
        time.sleep(1.0)
    return time.monotonic() - start


@dataclass(frozen=True)
class Limits:
    """The configuration every deployment of a run shares."""

    batch_size: int
    max_input_tokens: int
    max_output_tokens: int


def deploy(settings: Settings, policy: str, limits: Limits, ttft_slo_ms: int) -> Served:
    """Deploy the model at tp=1, pp=1 with ``policy`` ("fcfs" or "edf") and the TTFT SLO.
    Packing placement puts every deployment of a run on the same virtual device (the same
    core), so policies compare on the same hardware."""
    deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
        grpc.insecure_channel(settings.address("deploy"))
    )
    request = deploy_pb.DeployRequest(
        model_id=MODEL_ID,
        max_input_tokens=limits.max_input_tokens,
        max_output_tokens=limits.max_output_tokens,
        config=common.DeploymentConfig(
            tensor_parallel=1, pipeline_parallel=1, batch_size=limits.batch_size
        ),
        placement_policy=common.PLACEMENT_POLICY_PACKING,
        objectives=common.ServiceObjectives(scheduling=POLICIES[policy], ttft_slo_ms=ttft_slo_ms),
    )
    for attempt in range(DEPLOY_ATTEMPTS):
        try:
            dep = deployer.Deploy(request, timeout=300).deployment
            break
        except grpc.RpcError as exc:
            # On a busy 2-core machine the agent's heartbeat can lapse for a moment
            # ("no live devices"); anything else, or a third lapse, is fatal.
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt + 1 == DEPLOY_ATTEMPTS:
                raise
            print(f"deploy refused ({exc.details()}); retrying", file=sys.stderr)
            time.sleep(5.0)
    return Served(
        dep.deployment_id,
        policy,
        ttft_slo_ms,
        dep.config.batch_size,
        dep.max_input_tokens,
        dep.max_output_tokens,
    )


def deploy_policies(
    settings: Settings,
    policies: Sequence[str],
    limits: Limits,
    ttft_slo_ms: int,
    slo_multiple: float,
) -> tuple[dict[str, Served], int, float]:
    """One deployment per policy, all with the same configuration and TTFT SLO:
    (deployments by policy, the SLO in ms, the unloaded TTFT in ms of a prompt of
    max_input tokens). ``ttft_slo_ms`` 0 means ``slo_multiple`` x that unloaded TTFT,
    rounded up to SLO_ROUNDING_MS."""
    first = deploy(settings, policies[0], limits, ttft_slo_ms)
    unloaded = unloaded_ttft_ms(settings.address("scheduler"), first, limits.max_input_tokens)
    slo_ms = ttft_slo_ms or SLO_ROUNDING_MS * math.ceil(slo_multiple * unloaded / SLO_ROUNDING_MS)
    if not ttft_slo_ms:
        remove(settings, first)
        first = deploy(settings, policies[0], limits, slo_ms)
    served = {policies[0]: first}
    served.update({p: deploy(settings, p, limits, slo_ms) for p in policies[1:]})
    return served, slo_ms, unloaded


def unloaded_ttft_ms(address: str, served: Served, prompt_tokens: int) -> float:
    """Median client-side TTFT of 5 sequential requests (after one warm-up)."""
    jobs = [Job(0.0, prompt_tokens, 2)] * 6
    outcomes, _ = asyncio.run(closed_loop(address, served, jobs, 1, 60.0))
    return median([o.ttft_ms for o in outcomes[1:]])


def capacity_per_s(address: str, served: Served, jobs: Sequence[Job]) -> float:
    """Requests per second completed with 2 x batch always in flight (``jobs`` sent
    closed-loop, their times ignored). RuntimeError when one of them is not completed."""
    outcomes, seconds = asyncio.run(
        closed_loop(address, served, jobs, 2 * served.batch_size, 300.0, salt=10**6)
    )
    counted = tally(jobs, outcomes)
    if counted.completed != len(jobs):
        raise RuntimeError(f"capacity run lost requests: {counted.line()}")
    return counted.completed / seconds


def remove(settings: Settings, served: Served) -> None:
    deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
        grpc.insecure_channel(settings.address("deploy"))
    )
    deployer.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=served.deployment_id), timeout=120
    )


def scheduler_pid(settings: Settings) -> int:
    """The scheduler's pid, from the stack's stack.json."""
    return int(read_stack_file(settings.state_dir)["pids"]["scheduler"])


@dataclass(frozen=True)
class Job:
    """One request to send: when (seconds after the run starts), its token counts, and
    whether it asks for the front of the queue or carries its own deadline."""

    at_s: float
    prompt_tokens: int
    output_tokens: int
    priority: bool = False
    deadline_ms: int = 0


@dataclass(frozen=True)
class Outcome:
    """How one request ended, as the client saw it. Times in milliseconds."""

    code: str  # "OK", a grpc.StatusCode name, or "HUNG" (client timeout)
    tokens: int
    ttft_ms: float
    tpot_ms: float
    finished: bool  # a final message arrived
    sent_at_s: float
    done_at_s: float
    detail: str = ""


def prompt_ids(length: int, salt: int, vocab: int = MODEL_SHAPE["vocab_size"]) -> list[int]:
    """A prompt of ``length`` token ids, different per request (no cache can share it)."""
    return [(salt * 7919 + i * 31) % (vocab - 3) + 3 for i in range(length)]


async def send(
    stub: inference_service_pb2_grpc.InferenceServiceStub,
    served: Served,
    job: Job,
    salt: int,
    start: float,
    timeout_s: float,
) -> Outcome:
    """Wait until ``job.at_s``, send it, stream it to the end (or the timeout)."""
    await asyncio.sleep(max(0.0, start + job.at_s - time.perf_counter()))
    sent = time.perf_counter()
    stamps: list[float] = []
    finished = False
    code, detail = OK, ""
    call = stub.Generate(
        infer_pb.GenerateRequest(
            request_id=f"r{salt}",
            deployment_id=served.deployment_id,
            prompt_token_ids=prompt_ids(job.prompt_tokens, salt),
            max_tokens=job.output_tokens,
            sampling=common.SamplingParams(ignore_eos=True),
            priority=job.priority,
            deadline_ms=job.deadline_ms,
        ),
        timeout=timeout_s,
    )
    try:
        async for message in call:
            if message.HasField("delta") and len(message.delta.token_ids):
                stamps.extend([time.perf_counter()] * len(message.delta.token_ids))
            elif message.HasField("final"):
                finished = True
    except grpc.aio.AioRpcError as exc:
        code, detail = exc.code().name, exc.details() or ""
    done = time.perf_counter()
    if code == "DEADLINE_EXCEEDED" and done - sent >= 0.99 * timeout_s:
        code = HUNG  # the client's own timeout, not the scheduler's refusal
    gaps = len(stamps) - 1
    return Outcome(
        code=code,
        tokens=len(stamps),
        ttft_ms=(stamps[0] - sent) * 1e3 if stamps else math.nan,
        tpot_ms=(stamps[-1] - stamps[0]) / gaps * 1e3 if gaps > 0 else math.nan,
        finished=finished,
        sent_at_s=sent - start,
        done_at_s=done - start,
        detail=detail,
    )


async def replay(
    address: str, served: Served, jobs: Sequence[Job], timeout_s: float, salt: int = 0
) -> list[Outcome]:
    """Send ``jobs`` open-loop (one task each, at its own time) and wait for all."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
        start = time.perf_counter() + 0.05
        return list(
            await asyncio.gather(
                *(send(stub, served, job, salt + i, start, timeout_s) for i, job in enumerate(jobs))
            )
        )


def mixed_jobs(
    clients: int, per_client: int, prompt_tokens: int, output_tokens: int, deadline_ms: int
) -> list[list[Job]]:
    """Each client's requests: every third asks for the front of the queue, every fourth
    carries ``deadline_ms`` (the rest none)."""
    return [
        [
            Job(0.0, prompt_tokens, output_tokens, n % 3 == 0, deadline_ms if n % 4 == 3 else 0)
            for n in range(per_client)
        ]
        for _ in range(clients)
    ]


async def clients_closed_loop(
    address: str, served: Served, per_client: Sequence[Sequence[Job]], timeout_s: float
) -> tuple[list[Outcome], float]:
    """Each client (its own channel) sends its jobs back to back, all clients at once;
    (outcomes in client then job order, seconds it took)."""
    start = time.perf_counter()
    runs = await asyncio.gather(
        *(
            closed_loop(address, served, jobs, 1, timeout_s, salt=i * 100_000)
            for i, jobs in enumerate(per_client)
        )
    )
    return [o for outcomes, _ in runs for o in outcomes], time.perf_counter() - start


async def closed_loop(
    address: str,
    served: Served,
    jobs: Sequence[Job],
    concurrency: int,
    timeout_s: float,
    salt: int = 0,
) -> tuple[list[Outcome], float]:
    """Send ``jobs`` (their ``at_s`` ignored) keeping ``concurrency`` in flight;
    (outcomes in job order, seconds it took)."""
    pending = iter(enumerate(jobs))
    outcomes: list[Outcome | None] = [None] * len(jobs)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
        start = time.perf_counter()

        async def lane() -> None:
            for i, job in pending:
                now = time.perf_counter() - start
                outcomes[i] = await send(
                    stub,
                    served,
                    dataclasses.replace(job, at_s=now),
                    salt + i,
                    start,
                    timeout_s,
                )

        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return outcomes, time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; nan when empty."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def completed(outcome: Outcome, job: Job) -> bool:
    """Ended OK with a final message and every token it asked for."""
    return outcome.code == OK and outcome.finished and outcome.tokens == job.output_tokens


@dataclass(frozen=True)
class Tally:
    """Every request's ending, counted; ``reconciles`` when nothing else happened."""

    sent: int
    completed: int
    codes: Counter

    @property
    def refused(self) -> int:
        return sum(self.codes[c] for c in REFUSALS)

    @property
    def failed(self) -> int:
        return self.sent - self.completed - self.refused

    @property
    def reconciles(self) -> bool:
        return self.failed == 0

    def line(self) -> str:
        refusals = ", ".join(f"{c} {self.codes[c]}" for c in REFUSALS)
        others = {c: n for c, n in self.codes.items() if c not in (*REFUSALS, OK)}
        incomplete = self.codes[OK] - self.completed
        extra = f"; OTHER {dict(others)}" if others else ""
        extra += f"; OK but incomplete {incomplete}" if incomplete else ""
        verdict = "reconciles" if self.reconciles else "DOES NOT RECONCILE"
        return (
            f"sent {self.sent} = completed {self.completed} + refused {self.refused} "
            f"({refusals}){extra}: {verdict}"
        )


def tally(jobs: Sequence[Job], outcomes: Sequence[Outcome]) -> Tally:
    done = sum(completed(o, j) for o, j in zip(outcomes, jobs, strict=True))
    return Tally(len(jobs), done, Counter(o.code for o in outcomes))


def scheduler_counts(samples: dict, deployment_id: str) -> dict[str, float]:
    """The scheduler's own tally of one deployment's requests, from its Prometheus samples
    ({(name, labels): value}): completed ("OK"), each failure code, and "tokens" streamed."""
    counts: Counter = Counter()
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if labels.get("deployment_id") != deployment_id:
            continue
        if name == "iserve_request_success_total":
            counts[OK] += value
        elif name == "iserve_request_failure_total":
            counts[labels["code"]] += value
        elif name == "iserve_generation_tokens_total":
            counts["tokens"] += value
    return dict(counts)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan
