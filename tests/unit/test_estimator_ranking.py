"""Ranking for each intent, through the functions RankConfigs is built from."""

from __future__ import annotations

import numpy as np
import pytest

from estimator_svc.calibration_message import load_shipped
from estimator_svc.config_map import build_config_map
from estimator_svc.messages import (
    estimate_messages,
    ranked_messages,
    workload_from_proto,
)
from estimator_svc.ranking import formula_cost, rank_for_intent
from services.api import common_pb2 as common
from services.api import estimator_service_pb2 as estimator_pb
from services.errors import FailedPrecondition, InvalidArgument
from services.estimation.memory import GIB
from services.estimation.model_references import Workload
from services.estimation.score import unfit_note
from services.intents import check_intent
from tests.unit.estimator_data import tiny_model, tiny_rows

K = common


@pytest.fixture(scope="module")
def estimated():
    config_map = build_config_map(
        tiny_model(), tiny_rows(), load_shipped("cpu-x86_64"), "cpu-x86_64", now_ms=0
    )
    # 1.2 GiB devices: the largest layouts of fp16 do not fit.
    estimates, workload = config_map.estimate(Workload(output_tokens=64), 4, 1.2)
    assert not estimates.fits.all() and estimates.fits.any()
    return estimates, workload


def best(estimates, key: np.ndarray) -> int:
    fitting = np.flatnonzero(estimates.fits)
    return int(fitting[np.argmin(key[fitting])])


@pytest.mark.parametrize(
    ("kind", "formula", "key"),
    [
        (K.INTENT_KIND_MIN_LATENCY, 0, lambda e: e.latency_s),
        (K.INTENT_KIND_MIN_COST, 0, lambda e: e.memory_total_gib * e.latency_s),
        (K.INTENT_KIND_MIN_COST, K.COST_FORMULA_MEMORY, lambda e: e.memory_total_gib),
        (K.INTENT_KIND_MIN_COST, K.COST_FORMULA_DEVICE_HOURS, lambda e: e.cost_device_hours),
        (K.INTENT_KIND_MIN_MEMORY, 0, lambda e: e.memory_total_gib),
        (K.INTENT_KIND_MIN_DEVICE_HOURS, 0, lambda e: e.cost_device_hours),
        (K.INTENT_KIND_MAX_THROUGHPUT, 0, lambda e: -e.throughput_tokens_per_s_per_device),
    ],
)
def test_each_intent_ranks_its_best_configuration_first(estimated, kind, formula, key):
    estimates, _ = estimated
    ranked = rank_for_intent(estimates, K.Intent(kind=kind, cost_formula=formula))
    assert ranked.indices[0] == best(estimates, key(estimates))
    assert ranked.meets_intent.all()
    assert ranked.indices.size == estimates.fits.sum()
    unfit = int(np.count_nonzero(estimates.estimable & ~estimates.fits))
    assert unfit_note(unfit) in ranked.note


def test_an_accuracy_floor_excludes_the_variants_below_it(estimated):
    estimates, _ = estimated
    intent = K.Intent(kind=K.INTENT_KIND_MIN_LATENCY, min_accuracy=95.0)
    ranked = rank_for_intent(estimates, intent)
    names = {estimates.space.variants[estimates.space.variant[i]].name for i in ranked.indices}
    assert "int4" not in names and names <= {"fp16", "int8"}
    assert ranked.meets_intent.all()


def test_a_floor_nobody_meets_fails_or_is_relaxed_with_a_note(estimated):
    estimates, _ = estimated
    with pytest.raises(FailedPrecondition, match="accuracy floor of 101 .best available: 100."):
        rank_for_intent(estimates, K.Intent(kind=K.INTENT_KIND_MIN_COST, min_accuracy=101))
    relaxed = rank_for_intent(
        estimates,
        K.Intent(kind=K.INTENT_KIND_MIN_COST, min_accuracy=101, allow_best_available_accuracy=True),
    )
    assert "ranking the most accurate available (100)" in relaxed.note
    assert set(estimates.accuracy_pct[relaxed.indices]) == {100.0}
    # Each is kept as a fallback, and says it is the floor it misses (a tester read
    # "does not meet the intent" and could not tell which part).
    assert not relaxed.meets_intent.any()
    assert set(relaxed.shortfalls) == {"its accuracy 100 is under the floor of 101"}


def test_latency_slo_keeps_the_cheapest_under_it_or_falls_back(estimated):
    estimates, _ = estimated
    fitting = estimates.fits
    slo_s = float(np.median(estimates.latency_s[fitting]))
    met = rank_for_intent(
        estimates, K.Intent(kind=K.INTENT_KIND_LATENCY_SLO, latency_slo_ms=slo_s * 1e3)
    )
    assert (estimates.latency_s[met.indices] <= slo_s).all() and met.meets_intent.all()
    under = fitting & (estimates.latency_s <= slo_s)
    assert met.indices[0] == best(
        estimates, np.where(under, estimates.memory_total_gib * estimates.latency_s, np.inf)
    )
    missed = rank_for_intent(estimates, K.Intent(kind=K.INTENT_KIND_LATENCY_SLO, latency_slo_ms=1))
    assert "no configuration meets the latency SLO of 0.001 s" in missed.note
    assert missed.indices[0] == best(estimates, estimates.latency_s)
    assert not missed.meets_intent.any()
    first_s = estimates.latency_s[missed.indices[0]]
    assert missed.shortfalls[0] == f"its estimated latency {first_s:.3g} s is over the 0.001 s SLO"
    assert met.shortfalls == ("",) * met.indices.size


def test_cost_slo_in_the_formulas_unit(estimated):
    estimates, _ = estimated
    hours = formula_cost(estimates, K.COST_FORMULA_DEVICE_HOURS)
    budget = float(np.median(hours[estimates.fits]))
    ranked = rank_for_intent(
        estimates,
        K.Intent(
            kind=K.INTENT_KIND_COST_SLO,
            cost_formula=K.COST_FORMULA_DEVICE_HOURS,
            cost_budget=budget,
        ),
    )
    assert (hours[ranked.indices] <= budget).all()
    assert ranked.indices[0] == best(
        estimates, np.where(hours <= budget, estimates.latency_s, np.inf)
    )
    missed = rank_for_intent(estimates, K.Intent(kind=K.INTENT_KIND_COST_SLO, cost_budget=1e-9))
    assert "cost budget of 1e-09 GB*s" in missed.note
    assert missed.shortfalls[0].endswith("GB*s is over the budget of 1e-09 GB*s")
    # Both parts missed: both named.
    both = rank_for_intent(
        estimates,
        K.Intent(
            kind=K.INTENT_KIND_LATENCY_SLO,
            latency_slo_ms=1,
            min_accuracy=101,
            allow_best_available_accuracy=True,
        ),
    )
    assert " SLO" in both.shortfalls[0] and "under the floor of 101 and " in both.shortfalls[0]


@pytest.mark.parametrize(
    ("intent", "message"),
    [
        (K.Intent(), "unspecified"),
        (K.Intent(kind=K.INTENT_KIND_LATENCY_SLO), "latency_slo_ms"),
        (K.Intent(kind=K.INTENT_KIND_COST_SLO, cost_budget=-1), "cost_budget"),
        (K.Intent(kind=K.INTENT_KIND_MIN_COST, min_accuracy=float("nan")), "min_accuracy"),
    ],
)
def test_bad_intents_are_invalid_arguments(intent, message):
    # Checked once, where the intent enters a service (RankConfigs, Deploy).
    with pytest.raises(InvalidArgument, match=message):
        check_intent(intent)


def test_messages_carry_units_and_ranks(estimated):
    estimates, workload = estimated
    messages = estimate_messages(estimates, workload)
    assert len(messages) == estimates.space.size
    first = messages[0]
    assert first.config.tensor_parallel == 1 and first.config.variant_name == "fp16"
    assert first.config.weight_quant == K.WEIGHT_QUANT_NONE
    assert first.memory_total_bytes == round(estimates.memory_total_gib[0] * GIB)
    # The first token is TTFT's; each further one a TPOT.
    assert first.latency_ms == pytest.approx(
        first.ttft_ms + (workload.output_tokens - 1) * first.tpot_ms
    )
    assert first.cost_memory == pytest.approx(first.memory_total_bytes / 1e9)
    assert first.accuracy_score == 100.0
    # KV cache of batch x (prompt + output) tokens: 2 x 8 layers x 4 heads x 16 x 2 bytes.
    assert first.kv_cache_bytes == 2 * 8 * 4 * 16 * 2 * (32 + 64)

    ranked = rank_for_intent(estimates, K.Intent(kind=K.INTENT_KIND_MIN_LATENCY))
    entries = ranked_messages(estimates, workload, ranked)
    assert [e.rank for e in entries[:3]] == [1, 2, 3]
    assert all(e.meets_intent and not e.shortfall for e in entries)
    missed = rank_for_intent(estimates, K.Intent(kind=K.INTENT_KIND_LATENCY_SLO, latency_slo_ms=1))
    fallbacks = ranked_messages(estimates, workload, missed)
    assert fallbacks[0].shortfall == missed.shortfalls[0] and not fallbacks[0].meets_intent
    latencies = [e.estimate.latency_ms for e in entries]
    assert latencies == sorted(latencies)


def test_workload_checks():
    with pytest.raises(InvalidArgument, match="output_tokens"):
        workload_from_proto(estimator_pb.Workload(input_tokens=10))
    assert workload_from_proto(estimator_pb.Workload(output_tokens=5)).batch_size == 1
    # A deployment holds at most MAX_BATCH_SIZE sequences; beyond it (up to the uint32
    # the field carries) the request is refused, not an overflow deep in numpy.
    assert (
        workload_from_proto(estimator_pb.Workload(output_tokens=5, batch_size=256)).batch_size
        == 256
    )
    for batch in (257, 2**32 - 1):
        with pytest.raises(InvalidArgument, match=f"batch_size must be at most 256, got {batch}"):
            workload_from_proto(estimator_pb.Workload(output_tokens=5, batch_size=batch))
