"""Load against a live InferenceService: several clients, mixed priorities and deadlines,
every request accounted for. Used by ``bench/load_test.py`` (figures) and
``tests/integration/test_overload.py`` (the no-loss checks).

Each client is a thread with its own channel sending its requests back to back. A request
ends in one of two ways: its tokens and a final message (OK), or an explicit status. A
stream that ends without a final message, or with fewer tokens than its final message
counts, is a loss and is recorded as such (``LoadResult.lost``).
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.api import common_pb2 as common
from services.api import inference_service_pb2 as infer_pb
from services.api import inference_service_pb2_grpc

# Statuses a request under overload may end with and still be accounted for.
EXPLICIT = {
    "OK",
    grpc.StatusCode.RESOURCE_EXHAUSTED.name,
    grpc.StatusCode.DEADLINE_EXCEEDED.name,
}


@dataclass
class Outcome:
    client: int
    priority: bool
    deadline_ms: int
    code: str
    tokens: int
    final_tokens: int
    ttft_s: float | None
    total_s: float
    detail: str = ""


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def by_code(self) -> dict[str, int]:
        return dict(collections.Counter(o.code for o in self.outcomes))

    @property
    def lost(self) -> list[Outcome]:
        """Requests that ended without their tokens or an explicit status."""
        return [
            o
            for o in self.outcomes
            if o.code not in EXPLICIT or (o.code == "OK" and o.tokens != o.final_tokens)
        ]

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.outcomes)

    def ttft_ms(self, priority: bool) -> tuple[float, float] | None:
        """Median and 99th percentile TTFT of the OK requests of one priority."""
        values = sorted(
            o.ttft_s * 1e3 for o in self.outcomes if o.priority == priority and o.ttft_s is not None
        )
        if not values:
            return None
        p99 = values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]
        return statistics.median(values), p99


def run_load(
    channel_for: Callable[[], grpc.Channel],
    target: dict[str, str],
    *,
    clients: int,
    per_client: int,
    max_tokens: int,
    priority_every: int = 3,
    deadline_every: int = 4,
    deadline_ms: int = 200,
    call_timeout_s: float = 120.0,
) -> LoadResult:
    """Send ``clients`` × ``per_client`` requests to ``target`` ({"deployment_id": …} or
    {"model_id": …}): every ``priority_every``-th request of a client is a priority one,
    every ``deadline_every``-th carries ``deadline_ms``; each asks for ``max_tokens``
    tokens ignoring EOS."""
    result = LoadResult()
    lock = threading.Lock()

    def client(index: int) -> None:
        with channel_for() as channel:
            stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
            for n in range(per_client):
                priority = n % priority_every == 0
                deadline = deadline_ms if n % deadline_every == deadline_every - 1 else 0
                outcome = _one(stub, target, index, priority, deadline, max_tokens, call_timeout_s)
                with lock:
                    result.outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_s = time.perf_counter() - started
    return result


def _one(stub, target, index, priority, deadline_ms, max_tokens, timeout_s) -> Outcome:
    request = infer_pb.GenerateRequest(
        request_id=uuid.uuid4().hex[:16],
        prompt=f"client {index} asks for tokens",
        max_tokens=max_tokens,
        sampling=common.SamplingParams(ignore_eos=True),
        priority=priority,
        deadline_ms=deadline_ms,
        **target,
    )
    start = time.perf_counter()
    tokens, first, final = 0, None, None
    try:
        for message in stub.Generate(request, timeout=timeout_s):
            if message.HasField("delta"):
                if first is None and len(message.delta.token_ids):
                    first = time.perf_counter() - start
                tokens += len(message.delta.token_ids)
            elif message.HasField("final"):
                final = message.final
    except grpc.RpcError as exc:
        return Outcome(
            index,
            priority,
            deadline_ms,
            exc.code().name,
            tokens,
            0,
            first,
            time.perf_counter() - start,
            exc.details() or "",
        )
    if final is None:
        code, final_tokens = "NO_FINAL_MESSAGE", 0
    else:
        code, final_tokens = "OK", final.usage.completion_tokens
    return Outcome(
        index, priority, deadline_ms, code, tokens, final_tokens, first, time.perf_counter() - start
    )


def scheduler_counts(samples: dict, deployment_id: str) -> dict[str, float]:
    """The scheduler's own tally of one deployment's requests by ending, from its
    Prometheus samples ({(name, labels): value}): OK and each failure code, and tokens."""
    counts: dict[str, float] = collections.Counter()
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if labels.get("deployment_id") != deployment_id:
            continue
        if name == "iserve_request_success_total":
            counts["OK"] += value
        elif name == "iserve_request_failure_total":
            counts[labels["code"]] += value
        elif name == "iserve_generation_tokens_total":
            counts["tokens"] += value
    return dict(counts)
