"""What the scheduler measures of the requests it serves, for Prometheus and for status.

Names follow what vLLM users already scrape, with the ``iserve_`` prefix, labelled by
``model_id`` and ``deployment_id``:

- histograms ``time_to_first_token_seconds`` (arrival at the scheduler to the first
  token), ``inter_token_latency_seconds`` (one observation per gap between tokens),
  ``e2e_request_latency_seconds`` (arrival to the last token), and
  ``request_queue_time_seconds`` (waiting for a slot);
- gauges ``num_requests_running`` and ``num_requests_waiting`` (read from the queues
  when scraped, summed over a deployment's replicas);
- counters ``prompt_tokens_total``, ``generation_tokens_total``,
  ``request_success_total{finished_reason}``, ``request_failure_total{code}`` (every
  request that ended with an error status: refused, cancelled or failed midway);
- goodput, which none of vLLM, TGI or Triton exports: ``slo_attained_total`` and
  ``slo_missed_total``, counting requests that had an objective (the deployment's TTFT
  or TPOT SLO, its default deadline or their own ``deadline_ms``); a request that did
  not complete missed it, except one its client cancelled before it had missed any.

A request is recorded once, when it ends, from the times the servicer took anyway, so
the token loop does no metrics work.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler_svc.deadlines import has_objective, slo_attained
from scheduler_svc.predictor import LatencyPredictor
from services.api import common_pb2 as common
from services.ids import split_group_id
from services.metrics import PREFIX

CLIENT_FAULTS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)

LABELS = ("model_id", "deployment_id")
# vLLM's buckets, with finer ones below 10 ms for CPU deployments of small models.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0,
)  # fmt: skip
# Completed requests whose TTFT the status percentiles are taken over, per deployment.
RECENT_REQUESTS = 1024
FINISH_NAMES = {
    common.FINISH_REASON_LENGTH: "length",
    common.FINISH_REASON_STOP: "stop",
    common.FINISH_REASON_CANCELLED: "abort",
}

Snapshot = Callable[[], Iterable[tuple[str, int, int]]]
"""(queue id, running, waiting) of every queue (``QueueRegistry.snapshot``)."""

Predictions = Callable[[], Iterable[tuple[str, LatencyPredictor]]]
"""(queue id, its predictor) of every queue (``QueueRegistry.predictions``)."""


@dataclass
class RequestRecord:
    """One request as the servicer saw it; times in seconds on the scheduler's clock.

    ``code`` is OK for a request that streamed to its end; ``token_times`` holds when
    each token message reached the scheduler."""

    model_id: str
    deadline_ms: int
    arrival_s: float
    deployment_id: str = ""
    objectives: common.ServiceObjectives | None = None
    admitted_s: float | None = None
    # When it first joined a queue (kept when it moves on to another deployment).
    enqueued_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    # Prompt tokens the worker prefilled with this one's, its own included (0: unknown).
    prefilled_with: int = 0
    # Seconds its text prompt waited for the worker's encoding thread (the worker says).
    prompt_wait_s: float = 0.0
    completion_tokens: int = 0
    finish_reason: int = 0
    code: grpc.StatusCode = grpc.StatusCode.OK
    # When its client ended it, hanging up or by its call's deadline (None: it did not).
    cancelled_s: float | None = None


@dataclass
class _Tally:
    model_id: str
    completed: int = 0
    failed: int = 0
    attained: int = 0
    missed: int = 0
    recent_ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))


@dataclass(frozen=True)
class DeploymentStats:
    deployment_id: str
    model_id: str
    waiting: int
    running: int
    completed: int
    failed: int
    ttft_p50_s: float
    ttft_p95_s: float
    slo_attained: int
    slo_missed: int


def _percentile(values: Iterable[float], q: int) -> float:
    """The q-th percentile (of 100), 0.0 with no values."""
    values = sorted(values)
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


class _QueueGauges(Collector):
    """``num_requests_running`` and ``num_requests_waiting`` per deployment, read at
    scrape time, from this exporter's thread (``QueueRegistry.snapshot`` is safe there)."""

    def __init__(self, snapshot: Snapshot, model_of: Callable[[str], str]):
        self._snapshot = snapshot
        self._model_of = model_of

    def collect(self):
        queues = _by_deployment(self._snapshot())
        running = GaugeMetricFamily(
            f"{PREFIX}num_requests_running", "Requests holding a slot", labels=LABELS
        )
        waiting = GaugeMetricFamily(
            f"{PREFIX}num_requests_waiting", "Requests waiting for a slot", labels=LABELS
        )
        for deployment_id, (run, wait) in queues.items():
            labels = [self._model_of(deployment_id), deployment_id]
            running.add_metric(labels, run)
            waiting.add_metric(labels, wait)
        yield running
        yield waiting


class _PredictionGauges(Collector):
    """What each replica's online latency model predicts now (scheduler_svc.predictor),
    read at scrape time: the lines EDF refuses and routes by, after their corrections."""

    def __init__(self, predictions: Predictions, model_of: Callable[[str], str]):
        self._predictions = predictions
        self._model_of = model_of

    def collect(self):
        labels = [*LABELS, "replica"]
        families = {
            name: GaugeMetricFamily(f"{PREFIX}predicted_{name}", text, labels=labels)
            for name, text in (
                ("prefill_fixed_seconds", "Predicted prefill time of a batch, fixed part"),
                ("prefill_seconds_per_token", "Predicted prefill time per prompt token"),
                ("decode_step_seconds", "Predicted decode step with one sequence"),
                (
                    "decode_seconds_per_extra_sequence",
                    "Predicted decode step time added by each further sequence",
                ),
            )
        }
        for queue_id, predictor in list(self._predictions()):
            deployment_id, replica = split_group_id(queue_id)
            values = (*predictor.prefill.coefficients, *predictor.decode.coefficients)
            label_values = [self._model_of(deployment_id), deployment_id, str(replica)]
            # As the predictions read the lines (a falling one flat, its slope 0): each
            # coefficient clamped alone showed 120 ms a decode step where the prediction
            # was 5 ms (a tester).
            for family, value in zip(families.values(), values, strict=True):
                family.add_metric(label_values, max(0.0, value))
        yield from families.values()


def _missed_before(r: RequestRecord, objectives: common.ServiceObjectives, at_s: float) -> bool:
    """Whether a request its client cancelled at ``at_s`` had missed an objective by then:
    no first token within the TTFT SLO, its tokens so far further apart than the TPOT
    SLO, or its deadline passed. One cancelled in time was neither met nor missed: a
    client that gives up on an answer it no longer wants does not lower goodput."""
    times = r.token_times
    first_s = times[0] if times else at_s
    if objectives.ttft_slo_ms and (first_s - r.arrival_s) * 1e3 > objectives.ttft_slo_ms:
        return True
    gaps_ms = (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else 0.0
    if objectives.tpot_slo_ms and gaps_ms > objectives.tpot_slo_ms:
        return True
    deadline_ms = r.deadline_ms or objectives.default_deadline_ms
    return bool(deadline_ms and (at_s - r.arrival_s) * 1e3 > deadline_ms)


def _by_deployment(queues: Iterable[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """(running, waiting) per deployment, replicas' queues summed."""
    totals: dict[str, tuple[int, int]] = {}
    for queue_id, running, waiting in queues:
        deployment_id, _ = split_group_id(queue_id)
        run, wait = totals.get(deployment_id, (0, 0))
        totals[deployment_id] = (run + running, wait + waiting)
    return totals


class ServingMetrics:
    """The scheduler's Prometheus metrics and per-deployment tallies for status."""

    def __init__(
        self,
        registry: CollectorRegistry,
        snapshot: Snapshot,
        predictions: Predictions = lambda: (),
        known_model: Callable[[str], str] = lambda deployment_id: "",
    ):
        self._snapshot = snapshot
        self._tallies: dict[str, _Tally] = {}
        # The model of a deployment no request has ended on yet (the router's record):
        # its queue can be scraped before, and its gauges' model_id changed from "" then.
        self._known_model = known_model

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, help_text, LABELS, buckets=buckets, registry=registry)

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, help_text, LABELS + extra, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS)
        self.inter_token = histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens", INTER_TOKEN_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last token", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting for a slot", REQUEST_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of completed requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated and streamed")
        self.success = counter(
            "request_success", "Requests streamed to their end", ("finished_reason",)
        )
        self.failure = counter(
            "request_failure", "Requests ended by an error status (refused or failed)", ("code",)
        )
        self.slo_attained = counter("slo_attained", "Requests that met every objective")
        self.slo_missed = counter("slo_missed", "Requests with an objective they did not meet")
        registry.register(_QueueGauges(snapshot, self._model_of))
        registry.register(_PredictionGauges(predictions, self._model_of))
        self._labelled = (
            self.ttft,
            self.inter_token,
            self.e2e,
            self.queue_time,
            self.prompt_tokens,
            self.generation_tokens,
            self.success,
            self.failure,
            self.slo_attained,
            self.slo_missed,
        )

    def _model_of(self, deployment_id: str) -> str:
        tally = self._tallies.get(deployment_id)
        return tally.model_id if tally is not None else self._known_model(deployment_id)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the series and tallies of deployments not in ``keep`` (removed ones):
        kept, each removed deployment would cost every scrape and status call its ~100
        series for the life of the scheduler. Rates over a removed deployment's counters
        end with it, as for any series whose object is gone."""
        keep = set(keep)
        gone = [d for d in self._tallies if d and d not in keep]
        for deployment_id in gone:
            del self._tallies[deployment_id]
            for metric in self._labelled:
                metric.remove_by_labels({"deployment_id": deployment_id})

    def seen(self, deployment_id: str, model_id: str) -> None:
        """A request was routed to ``deployment_id`` of ``model_id``: its stats and queue
        gauges carry the model from now on, not only once a request has ended."""
        if deployment_id and deployment_id not in self._tallies:
            self._tallies[deployment_id] = _Tally(model_id)

    def record(self, r: RequestRecord) -> None:
        """Count one request that has ended, however it ended."""
        labels = (r.model_id, r.deployment_id)
        tally = self._tallies.get(r.deployment_id)
        if tally is None:
            tally = self._tallies[r.deployment_id] = _Tally(r.model_id)
        objectives = r.objectives or common.ServiceObjectives()
        if r.enqueued_s is not None and r.admitted_s is not None:
            self.queue_time.labels(*labels).observe(r.admitted_s - r.enqueued_s)
        times = r.token_times
        if times:
            # Also for a request that ended otherwise after its first token (its client
            # hung up, its worker died): it got one. Left out, early hang-ups (often the
            # slow ones) made TTFT look better than it was.
            ttft_s = times[0] - r.arrival_s
            tally.recent_ttft_s.append(ttft_s)
            self.ttft.labels(*labels).observe(ttft_s)
        if r.code != grpc.StatusCode.OK:
            tally.failed += 1
            self.failure.labels(*labels, r.code.name).inc()
            if times:
                # Its prompt was prefilled (it had a first token): both counts, as the
                # worker did both (the generated tokens alone were counted).
                self.prompt_tokens.labels(*labels).inc(r.prompt_tokens)
                self.generation_tokens.labels(*labels).inc(len(times))
            # A request refused as invalid, or as not the caller's to make, was never the
            # deployment's to serve: it fails, but a client's malformed or unpermitted
            # requests must not lower the deployment's goodput. Nor did one refused before
            # any deployment took it (an unknown model with a deadline was a miss of
            # deployment "").
            if (
                r.deployment_id
                and r.code not in CLIENT_FAULTS
                and has_objective(objectives, r.deadline_ms)
                and (r.cancelled_s is None or _missed_before(r, objectives, r.cancelled_s))
            ):
                tally.missed += 1
                self.slo_missed.labels(*labels).inc()
            return
        tally.completed += 1
        self.success.labels(*labels, FINISH_NAMES.get(r.finish_reason, "unknown")).inc()
        self.prompt_tokens.labels(*labels).inc(r.prompt_tokens)
        self.generation_tokens.labels(*labels).inc(r.completion_tokens)
        if not times:
            return
        self.e2e.labels(*labels).observe(times[-1] - r.arrival_s)
        gaps = self.inter_token.labels(*labels)
        for before, after in zip(times, times[1:], strict=False):
            gaps.observe(after - before)
        tokens = len(times)
        attained = slo_attained(
            objectives,
            r.deadline_ms,
            ttft_ms=ttft_s * 1e3,
            tpot_ms=(times[-1] - times[0]) / (tokens - 1) * 1e3 if tokens > 1 else 0.0,
            total_ms=(times[-1] - r.arrival_s) * 1e3,
            tokens=tokens,
        )
        if attained is True:
            tally.attained += 1
            self.slo_attained.labels(*labels).inc()
        elif attained is False:
            tally.missed += 1
            self.slo_missed.labels(*labels).inc()

    def stats(self) -> list[DeploymentStats]:
        """Per deployment this scheduler has seen or queues for, sorted by id."""
        queues = _by_deployment(self._snapshot())
        result = []
        for deployment_id in sorted(set(self._tallies) | set(queues)):
            if not deployment_id:
                continue  # requests refused before any deployment was resolved
            tally = self._tallies.get(deployment_id) or _Tally("")
            running, waiting = queues.get(deployment_id, (0, 0))
            recent = list(tally.recent_ttft_s)
            result.append(
                DeploymentStats(
                    deployment_id=deployment_id,
                    model_id=tally.model_id,
                    waiting=waiting,
                    running=running,
                    completed=tally.completed,
                    failed=tally.failed,
                    ttft_p50_s=_percentile(recent, 50),
                    ttft_p95_s=_percentile(recent, 95),
                    slo_attained=tally.attained,
                    slo_missed=tally.missed,
                )
            )
        return result
