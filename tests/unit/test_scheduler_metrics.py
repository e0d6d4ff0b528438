"""The scheduler's metrics from request records, without a server."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.metrics import RequestRecord, ServingMetrics
from services.api import common_pb2 as common
from services.metrics import RpcMetrics, new_registry

IDS = {"model_id": "m", "deployment_id": "d1"}
TTFT_SLO = common.ServiceObjectives(ttft_slo_ms=100)


def build(queues=()):
    registry = CollectorRegistry()
    return registry, ServingMetrics(registry, lambda: list(queues))


def served(arrival=0.0, tokens=(0.05, 0.06, 0.07), objectives=None, deadline_ms=0, **fields):
    return RequestRecord(
        model_id="m",
        deadline_ms=deadline_ms,
        arrival_s=arrival,
        deployment_id="d1",
        objectives=objectives,
        enqueued_s=arrival,
        admitted_s=arrival + 0.01,
        token_times=[arrival + t for t in tokens],
        prompt_tokens=fields.get("prompt_tokens", 5),
        completion_tokens=len(tokens),
        finish_reason=common.FINISH_REASON_LENGTH,
    )


def test_a_completed_request_moves_every_series_once():
    registry, metrics = build()
    metrics.record(served())
    get = registry.get_sample_value
    assert get("iserve_request_success_total", {**IDS, "finished_reason": "length"}) == 1
    assert get("iserve_prompt_tokens_total", IDS) == 5
    assert get("iserve_generation_tokens_total", IDS) == 3
    assert get("iserve_time_to_first_token_seconds_count", IDS) == 1
    assert get("iserve_time_to_first_token_seconds_sum", IDS) == pytest.approx(0.05)
    assert get("iserve_inter_token_latency_seconds_count", IDS) == 2
    assert get("iserve_inter_token_latency_seconds_sum", IDS) == pytest.approx(0.02)
    assert get("iserve_e2e_request_latency_seconds_sum", IDS) == pytest.approx(0.07)
    assert get("iserve_request_queue_time_seconds_sum", IDS) == pytest.approx(0.01)
    # No objective: goodput counts neither way.
    assert get("iserve_slo_attained_total", IDS) in (None, 0)
    assert get("iserve_slo_missed_total", IDS) in (None, 0)


def test_slo_attained_and_missed_per_request():
    registry, metrics = build()
    metrics.record(served(objectives=TTFT_SLO))  # TTFT 50 ms <= 100
    metrics.record(served(objectives=TTFT_SLO, tokens=(0.2, 0.21)))  # 200 ms > 100
    metrics.record(served(deadline_ms=50))  # its own deadline, last token at 70 ms
    assert registry.get_sample_value("iserve_slo_attained_total", IDS) == 1
    assert registry.get_sample_value("iserve_slo_missed_total", IDS) == 2
    (stats,) = metrics.stats()
    assert (stats.slo_attained, stats.slo_missed, stats.completed) == (1, 2, 3)


def test_a_refused_request_counts_by_code_and_misses_its_objective():
    registry, metrics = build()
    refused = RequestRecord("m", 0, 0.0, deployment_id="d1", objectives=TTFT_SLO)
    refused.code = grpc.StatusCode.DEADLINE_EXCEEDED
    metrics.record(refused)
    early = RequestRecord("", 0, 0.0)  # refused before a deployment was resolved
    early.code = grpc.StatusCode.NOT_FOUND
    metrics.record(early)
    get = registry.get_sample_value
    assert get("iserve_request_failure_total", {**IDS, "code": "DEADLINE_EXCEEDED"}) == 1
    assert get("iserve_slo_missed_total", IDS) == 1
    assert (
        get(
            "iserve_request_failure_total",
            {"model_id": "", "deployment_id": "", "code": "NOT_FOUND"},
        )
        == 1
    )
    assert get("iserve_time_to_first_token_seconds_count", IDS) in (None, 0)
    assert [s.deployment_id for s in metrics.stats()] == ["d1"]  # "" is not a deployment


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED]
)
def test_a_client_s_own_fault_fails_without_missing_an_objective(code):
    """A client's malformed requests (max_tokens over the limit), or ones its token does
    not permit, must not lower the deployment's SLO attainment."""
    registry, metrics = build()
    invalid = RequestRecord("m", 0, 0.0, deployment_id="d1", objectives=TTFT_SLO)
    invalid.code = code
    metrics.record(invalid)
    get = registry.get_sample_value
    assert get("iserve_request_failure_total", {**IDS, "code": code.name}) == 1
    assert get("iserve_slo_missed_total", IDS) in (None, 0)
    (stats,) = metrics.stats()
    assert (stats.failed, stats.slo_missed) == (1, 0)


def test_a_request_no_deployment_took_misses_no_objective():
    """An unknown model's requests with a deadline counted as SLO misses of deployment
    "" (a probe: 3 refusals, slo_missed_total{deployment_id=""} 3)."""
    registry, metrics = build()
    refused = RequestRecord("", 5, 0.0, code=grpc.StatusCode.NOT_FOUND)
    metrics.record(refused)
    ids = {"model_id": "", "deployment_id": ""}
    assert registry.get_sample_value("iserve_request_failure_total", {**ids, "code": "NOT_FOUND"})
    assert registry.get_sample_value("iserve_slo_missed_total", ids) in (None, 0)


def test_a_removed_deployment_leaves_no_series_or_tally():
    registry, metrics = build()
    metrics.record(served())
    other = served()
    other.deployment_id = "d2"
    metrics.record(other)
    refused = RequestRecord("", 0, 0.0)  # refused before a deployment was resolved
    refused.code = grpc.StatusCode.NOT_FOUND
    metrics.record(refused)
    metrics.forget(keep=["d2"])
    scraped = generate_latest(registry).decode()
    assert 'deployment_id="d1"' not in scraped
    assert 'deployment_id="d2"' in scraped
    assert 'deployment_id=""' in scraped  # not a deployment: refusals before routing stay
    assert [s.deployment_id for s in metrics.stats()] == ["d2"]


def test_tokens_streamed_before_a_failure_still_count():
    registry, metrics = build()
    cut = served()
    cut.code = grpc.StatusCode.UNAVAILABLE
    metrics.record(cut)
    assert registry.get_sample_value("iserve_generation_tokens_total", IDS) == 3
    # Its prompt was prefilled too (only the generated tokens were counted, a probe).
    assert registry.get_sample_value("iserve_prompt_tokens_total", IDS) == 5
    assert (
        registry.get_sample_value("iserve_request_failure_total", {**IDS, "code": "UNAVAILABLE"})
        == 1
    )


def test_a_request_ended_after_its_first_token_counts_in_ttft():
    """A probe: five clients that hung up after the first chunk got a first token, but
    none was in the TTFT histogram or `iserve status`'s percentiles."""
    registry, metrics = build()
    hung_up = served(tokens=(0.4,))
    hung_up.code = grpc.StatusCode.CANCELLED
    metrics.record(hung_up)
    never = RequestRecord("m", 0, 0.0, deployment_id="d1", code=grpc.StatusCode.CANCELLED)
    metrics.record(never)  # no first token: none counted
    assert registry.get_sample_value("iserve_time_to_first_token_seconds_count", IDS) == 1
    assert registry.get_sample_value("iserve_time_to_first_token_seconds_sum", IDS) == (
        pytest.approx(0.4)
    )
    [stats] = metrics.stats()
    assert stats.ttft_p50_s == pytest.approx(0.4)


def test_queue_gauges_sum_replicas_and_status_percentiles():
    queues = [("d1", 2, 3), ("d1.r1", 1, 4), ("d2", 0, 0)]
    registry, metrics = build(queues)
    for i in range(100):
        metrics.record(served(tokens=(0.001 * (i + 1),)))
    text = generate_latest(registry).decode()
    samples = {
        (s.name, s.labels.get("deployment_id")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["iserve_num_requests_running", "d1"] == 3
    assert samples["iserve_num_requests_waiting", "d1"] == 7
    assert samples["iserve_num_requests_waiting", "d2"] == 0
    by_id = {s.deployment_id: s for s in metrics.stats()}
    assert by_id["d1"].ttft_p50_s == pytest.approx(0.0505)
    assert by_id["d1"].ttft_p95_s == pytest.approx(0.09505)
    assert (by_id["d1"].running, by_id["d1"].waiting) == (3, 7)
    assert by_id["d2"].completed == 0 and by_id["d2"].ttft_p50_s == 0.0


def test_a_deployment_names_its_model_before_any_request_has_ended():
    registry, metrics = build([("d1", 1, 0)])
    metrics.seen("d1", "m")
    [stats] = metrics.stats()
    assert (stats.model_id, stats.running, stats.completed) == ("m", 1, 0)
    text = generate_latest(registry).decode()
    assert 'iserve_num_requests_running{deployment_id="d1",model_id="m"} 1.0' in text


def test_rpc_counter_splits_the_method_name():
    registry = new_registry()
    metrics = RpcMetrics(registry)
    metrics.count("/iserve.v1.InferenceService/Generate", grpc.StatusCode.OK)
    metrics.count("/iserve.v1.InferenceService/Generate", grpc.StatusCode.OK)
    labels = {
        "grpc_service": "iserve.v1.InferenceService",
        "grpc_method": "Generate",
        "grpc_code": "OK",
    }
    assert registry.get_sample_value("iserve_grpc_server_handled_total", labels) == 2
    assert registry.get_sample_value("process_resident_memory_bytes") > 0


def test_each_replicas_prediction_is_a_gauge():
    from scheduler_svc.predictor import LatencyPredictor

    predictor = LatencyPredictor(
        common.LatencyModel(
            prefill_fixed_ms=5,
            prefill_ms_per_token=0.5,
            decode_step_ms=20,
            decode_ms_per_extra_sequence=2,
        ),
        max_input_tokens=512,
        batch_size=4,
    )
    registry = CollectorRegistry()
    metrics = ServingMetrics(registry, lambda: [], lambda: [("d1.r1", predictor)])
    metrics.seen("d1", "m")
    get = registry.get_sample_value
    labels = {**IDS, "replica": "1"}
    assert get("iserve_predicted_prefill_fixed_seconds", labels) == pytest.approx(0.005)
    assert get("iserve_predicted_prefill_seconds_per_token", labels) == pytest.approx(0.0005)
    assert get("iserve_predicted_decode_step_seconds", labels) == pytest.approx(0.020)
    assert get("iserve_predicted_decode_seconds_per_extra_sequence", labels) == pytest.approx(0.002)
    predictor.observe(
        prompt_tokens=100, prompt_chars=0, first_token_s=0.5, tpot_s=0.2, running=1
    )  # ten times slower than predicted: the gauges follow
    assert get("iserve_predicted_decode_step_seconds", labels) > 0.05


def test_a_stream_the_client_closes_between_messages_is_counted_by_the_rpc_counter():
    """gRPC closes a streaming handler at a yield when the client goes away between
    messages (GeneratorExit): the per-call counter counts it CANCELLED, as the serving
    counters do; it counted nothing, so the two disagreed under cancellations."""
    import asyncio

    from services.grpc_server import ErrorInterceptor

    registry = new_registry()
    method = "/iserve.v1.InferenceService/Generate"

    async def behavior(_request, _context):
        for i in range(3):
            yield i

    class Context:
        def time_remaining(self) -> float | None:
            return None

    async def scenario():
        wrapped = ErrorInterceptor(RpcMetrics(registry))._wrap_stream(method, behavior)
        stream = wrapped(None, Context())
        assert await stream.__anext__() == 0
        await stream.aclose()
        assert [item async for item in wrapped(None, Context())] == [0, 1, 2]

    asyncio.run(scenario())
    get = registry.get_sample_value
    labels = {"grpc_service": "iserve.v1.InferenceService", "grpc_method": "Generate"}
    assert get("iserve_grpc_server_handled_total", {**labels, "grpc_code": "CANCELLED"}) == 1
    assert get("iserve_grpc_server_handled_total", {**labels, "grpc_code": "OK"}) == 1


def test_a_queue_scraped_before_any_request_ended_is_labelled_with_its_model():
    """A deployment's queue exists (a request waits on it, or routing looked at it)
    before any request on it ended: its gauges carry the model the router's record
    names, not model_id="" that later changes to the model (a dashboard saw two series)."""
    registry = CollectorRegistry()
    ServingMetrics(registry, lambda: [("d1", 0, 1)], known_model={"d1": "m"}.get)
    get = registry.get_sample_value
    assert get("iserve_num_requests_waiting", IDS) == 1
    assert get("iserve_num_requests_waiting", {"model_id": "", "deployment_id": "d1"}) is None


@pytest.mark.parametrize(
    ("tokens", "cancelled_s", "missed"),
    [
        ((), 0.05, 0),  # gave up before its TTFT SLO (100 ms) passed: neither
        ((), 0.5, 1),  # no first token within it: missed
        ((0.05, 0.06), 0.07, 0),  # on time so far
        ((0.3, 0.31), 0.32, 1),  # its first token came late
    ],
)
def test_a_cancelled_request_misses_only_what_it_had_missed(tokens, cancelled_s, missed):
    """A client that cancels a request still within its objectives does not lower the
    deployment's goodput (every cancellation counted as a miss); one cancelled after
    its TTFT SLO passed without a token did miss it. Both count as failed."""
    registry, metrics = build()
    record = RequestRecord("m", 0, 0.0, deployment_id="d1", objectives=TTFT_SLO)
    record.token_times.extend(tokens)
    record.code = grpc.StatusCode.CANCELLED
    record.cancelled_s = cancelled_s
    metrics.record(record)
    (stats,) = metrics.stats()
    assert (stats.failed, stats.slo_missed, stats.slo_attained) == (1, missed, 0)
    assert (registry.get_sample_value("iserve_slo_missed_total", IDS) or 0) == missed


def test_a_request_cancelled_past_its_deadline_missed_it():
    _, metrics = build()
    record = RequestRecord("m", 200, 0.0, deployment_id="d1")
    record.code = grpc.StatusCode.CANCELLED
    record.cancelled_s = 0.3
    metrics.record(record)
    (stats,) = metrics.stats()
    assert stats.slo_missed == 1
