"""A deployment's objectives, the scheduler's starting latency model and the batch size
the deployer chooses when a Deploy leaves it 0 (pure logic)."""

from __future__ import annotations

import dataclasses

import pytest

from deploy_svc import planning
from deploy_svc.objectives import (
    FALLBACK_DEADLINE_FACTOR,
    MAX_AUTO_BATCH,
    fallback_objectives,
    largest_fitting,
    latency_model,
    resolve_objectives,
    tpot_batch_bound,
)
from services.api import common_pb2 as common
from services.api import estimator_service_pb2 as estimator_pb
from services.errors import InvalidArgument
from services.state.capacity import free_bytes
from tests.unit.test_deploy_planning import GIB, LIMITS, model

EDF, FCFS = common.SCHEDULING_POLICY_EDF, common.SCHEDULING_POLICY_FCFS


def test_a_latency_target_no_configuration_meets_leaves_its_fallback_a_deadline_it_can_keep():
    """Deployed with a 1 ms target as the fastest fallback, every request without a
    deadline of its own was refused as late: they now default to 1.5x the fallback's
    estimated latency, and the decision says so."""
    slo = common.Intent(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=1)
    resolved = resolve_objectives(common.ServiceObjectives(), slo)
    assert resolved.default_deadline_ms == 1
    changed, note = fallback_objectives(resolved, slo, 0, False, 85.2)
    assert changed.default_deadline_ms == 128 == -(-FALLBACK_DEADLINE_FACTOR * 85.2 // 1)
    assert changed.scheduling == EDF and resolved.default_deadline_ms == 1
    assert "default to 128 ms" in note and "the 1 ms target" in note
    # A configuration that meets the target, a deadline the request set, another intent:
    # unchanged, nothing said.
    for args in (
        (resolved, slo, 0, True, 85.2),
        (resolved, slo, 5, False, 85.2),
        (resolved, common.Intent(kind=common.INTENT_KIND_MIN_COST), 0, False, 85.2),
        (resolved, None, 0, False, 85.2),
    ):
        assert fallback_objectives(*args) == (resolved, "")


@pytest.mark.parametrize(
    ("requested", "intent", "scheduling", "default_deadline"),
    [
        (common.ServiceObjectives(), None, FCFS, 0),
        (common.ServiceObjectives(), common.Intent(kind=common.INTENT_KIND_MIN_COST), FCFS, 0),
        (
            common.ServiceObjectives(),
            common.Intent(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=1500.5),
            EDF,
            1501,
        ),
        (
            common.ServiceObjectives(scheduling=FCFS),
            common.Intent(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=900),
            FCFS,
            900,
        ),
        (common.ServiceObjectives(scheduling=EDF, ttft_slo_ms=200), None, EDF, 0),
    ],
)
def test_objectives_resolve_the_policy(requested, intent, scheduling, default_deadline):
    resolved = resolve_objectives(requested, intent)
    assert resolved.scheduling == scheduling
    assert resolved.default_deadline_ms == default_deadline
    assert resolved.ttft_slo_ms == requested.ttft_slo_ms


def test_an_unknown_scheduling_policy_is_invalid():
    with pytest.raises(InvalidArgument, match="unknown scheduling policy 7"):
        resolve_objectives(common.ServiceObjectives(scheduling=7), None)


def test_the_latency_model_comes_from_the_estimates_at_batch_1_and_2():
    batch1 = estimator_pb.ConfigEstimate(ttft_ms=256.0, tpot_ms=20.0)
    batch2 = estimator_pb.ConfigEstimate(ttft_ms=500.0, tpot_ms=23.0)
    got = latency_model(batch1, batch2, input_tokens=512)
    assert got.prefill_ms_per_token == pytest.approx(0.5)
    assert got.prefill_fixed_ms == 0
    assert got.decode_step_ms == 20.0
    assert got.decode_ms_per_extra_sequence == pytest.approx(3.0)
    assert latency_model(None, None, 512) == common.LatencyModel()


@pytest.mark.parametrize(
    ("tpot1", "per_sequence", "slo", "batch", "phrase"),
    [
        (20.0, 2.0, 50, 16, "TPOT SLO 50 ms (estimated TPOT 50.0 ms at batch 16)"),
        (20.0, 2.0, 0, 6, "1.5x the batch-1 TPOT (30.0 ms)"),  # 20 + 5*2 = 30
        (20.0, 0.0, 0, MAX_AUTO_BATCH, "TPOT does not grow"),
        (60.0, 2.0, 50, 1, "missed even at batch 1"),
        (1.0, 0.001, 1000, MAX_AUTO_BATCH, "the cap"),
    ],
)
def test_the_tpot_bound_follows_eq_6(tpot1, per_sequence, slo, batch, phrase):
    bound = tpot_batch_bound(tpot1, per_sequence, slo)
    assert bound.batch == batch
    assert phrase in bound.reason


def test_largest_fitting_finds_the_edge():
    assert largest_fitting(64, lambda b: b <= 23) == 23
    assert largest_fitting(64, lambda b: True) == 64
    assert largest_fitting(1, lambda b: True) == 1


def _prepared(nodes, options, auto_batch=True, tpot_slo=0, **objectives) -> planning.Prepared:
    return planning.Prepared(
        model(),
        LIMITS,
        "hybrid",
        False,
        options,
        None,
        "ranked",
        nodes,
        common.ServiceObjectives(scheduling=EDF, tpot_slo_ms=tpot_slo, **objectives),
        auto_batch,
    )


def _nodes(*free_gib: float) -> list[common.NodeState]:
    node = common.NodeState(node_id="n", alive=True)
    for i, gib in enumerate(free_gib):
        total = int(gib * GIB)
        node.devices.add(
            ref=common.DeviceRef(node_id="n", device_id=f"cpu{i}"),
            hardware_type="cpu",
            total_bytes=total,
            free_bytes=free_bytes(total, 0, 0),
        )
    return [node]


def _estimates(kv_bytes: int):
    config = common.DeploymentConfig(
        tensor_parallel=1, pipeline_parallel=1, variant_name="fp32", batch_size=1
    )
    # 16 output tokens: latency = TTFT + 15 TPOT.
    batch1 = estimator_pb.ConfigEstimate(
        config=config,
        ttft_ms=100,
        tpot_ms=20,
        latency_ms=400,
        kv_cache_bytes=kv_bytes,
        memory_total_bytes=GIB,
        cost_device_hours=400 / 3.6e6,
        throughput_tokens_per_second_per_device=16 / 0.4,
    )
    batch2 = estimator_pb.ConfigEstimate(
        config=config, ttft_ms=180, tpot_ms=22, latency_ms=510, batch_measured=True
    )
    return config, batch1, batch2


def test_the_batch_is_the_largest_the_tpot_slo_allows_when_memory_is_plenty():
    config, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    nodes = _nodes(64)
    prepared = _prepared(nodes, [planning.Option(1, config, batch1)], tpot_slo=30)
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
    assert sized.config.batch_size == 6  # 20 + 5 * 2 = 30 ms
    assert "batch 6: bounded by TPOT SLO 30 ms" in sized.note
    assert (
        sized.placement.stages[0].reserved_bytes[0] > decision.placement.stages[0].reserved_bytes[0]
    )


@pytest.mark.parametrize(
    ("objectives", "batch", "phrase"),
    [
        # The latency SLO intent's target: 400 + (B - 1) * 110 <= 800 (TPOT alone: 6).
        ({"default_deadline_ms": 800}, 4, "latency 800 ms (the default deadline) (estimated 730.0"),
        ({"ttft_slo_ms": 300}, 3, "TTFT SLO 300 ms (estimated 260.0 ms at batch 3)"),
        ({"ttft_slo_ms": 90}, 1, "TTFT SLO 90 ms, missed even at batch 1"),
        ({"default_deadline_ms": 10_000, "ttft_slo_ms": 10_000}, 6, "1.5x the batch-1 TPOT"),
    ],
)
def test_the_batch_keeps_the_ttft_and_latency_objectives(objectives, batch, phrase):
    """A batch sized for TPOT alone broke a LATENCY_SLO intent's target that the
    configuration was ranked to meet at batch 1, and the decision showed batch 1's
    TTFT and latency beside the larger batch."""
    config, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    nodes = _nodes(64)
    prepared = _prepared(nodes, [planning.Option(1, config, batch1)], **objectives)
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
    assert sized.config.batch_size == batch
    assert phrase in sized.note
    e = sized.estimate
    assert e.config.batch_size == batch
    assert e.ttft_ms == pytest.approx(100 + (batch - 1) * 80)
    assert e.tpot_ms == pytest.approx(20 + (batch - 1) * 2)
    assert e.latency_ms == pytest.approx(400 + (batch - 1) * 110)
    assert e.memory_total_bytes == GIB + (batch - 1) * (1 << 20)
    # Per request: the batch holds the device for its latency and serves `batch` of them.
    assert e.cost_device_hours == pytest.approx(e.latency_ms / 3.6e6 / batch)
    assert e.throughput_tokens_per_second_per_device == pytest.approx(
        batch * 16 / (e.latency_ms / 1e3)
    )


def test_the_batch_stops_where_the_kv_cache_no_longer_fits():
    config, batch1, batch2 = _estimates(kv_bytes=256 << 20)  # 256 MiB per sequence
    nodes = _nodes(2.0)  # 1 GiB at batch 1: batch 5 holds 2 GiB
    prepared = _prepared(nodes, [planning.Option(1, config, batch1)])
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
    batch = sized.config.batch_size
    assert 1 < batch < 6  # 1.5x TPOT would allow 6 (20 + 5 * 2 = 30 ms)
    assert f"the KV cache of batch {batch + 1} does not fit" in sized.note
    reserved = sized.placement.stages[0].reserved_bytes[0]
    assert reserved <= 2.0 * GIB
    bigger = planning._decide_batch(prepared, decision, nodes, batch1, batch2, batch + 1)
    assert bigger is None


def test_without_an_estimate_the_batch_stays_1_and_says_why():
    config, batch1, _ = _estimates(kv_bytes=1 << 20)
    nodes = _nodes(64)
    prepared = _prepared(nodes, [planning.Option(1, config, None)])
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, None, None, prepared.objectives)
    assert sized.config.batch_size == 1
    assert "no estimate" in sized.note


def test_without_batch_2_profiles_the_batch_stays_1_and_says_why():
    config, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    batch2.batch_measured = False  # the estimator charged nothing for the batch
    nodes = _nodes(64)
    prepared = _prepared(nodes, [planning.Option(1, config, batch1)])
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
    assert sized.config.batch_size == 1
    assert "not profiled at batch 2" in sized.note


def test_a_bigger_batch_stays_on_the_devices_first_placed():
    config, batch1, batch2 = _estimates(kv_bytes=256 << 20)
    nodes = _nodes(2.5, 2.0)  # the second device could hold more layers, but was not chosen
    prepared = _prepared(nodes, [planning.Option(1, config, batch1)])
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
    first = {(d.node_id, d.device_id) for s in decision.placement.stages for d in s.devices}
    after = {(d.node_id, d.device_id) for s in sized.placement.stages for d in s.devices}
    assert after == first


def test_matching_estimate_finds_the_configuration():
    config, batch1, _ = _estimates(kv_bytes=1)
    other = estimator_pb.ConfigEstimate(
        config=common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=1, variant_name="fp32")
    )
    assert planning.matching_estimate([other, batch1], config) is batch1
    wanted = common.DeploymentConfig(tensor_parallel=4, pipeline_parallel=1)
    assert planning.matching_estimate([other, batch1], wanted) is None


def test_a_min_latency_intent_keeps_ttft_near_batch_1s():
    """Sized by TPOT alone, a min-latency deployment on the A6000 data (decode's extra
    sequence costs nothing measurable there) took 64 sequences, whose prefills made the
    full batch's TTFT 26 s where one took 0.53 s."""
    from deploy_svc.objectives import ttft_batch_bound

    # Prefill of each further sequence as long as the first's: batch 1 alone.
    assert ttft_batch_bound(530.0, 1060.0).batch == 1
    # A short prompt's prefill grows little: the TTFT bound is far off.
    assert ttft_batch_bound(49.0, 50.9).batch == 13
    assert ttft_batch_bound(49.0, 49.0).batch == 64  # the cap
    assert "1.5x the batch-1 TTFT (794.4 ms" in ttft_batch_bound(529.6, 1059.2).reason


def test_a_min_memory_intent_keeps_batch_1():
    """Sized by TPOT, a min-memory deployment of Llama-2-70B took 64 sequences: 41 GiB
    where the footprint it was ranked on was 33.6."""
    config, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    nodes = _nodes(64)
    prepared = dataclasses.replace(
        _prepared(nodes, [planning.Option(1, config, batch1)]),
        intent_kind=common.INTENT_KIND_MIN_MEMORY,
    )
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
    assert sized.config.batch_size == 1
    assert "batch 1: a min-memory intent holds one sequence's KV cache" in sized.note


def test_costs_at_a_batch_are_per_request_and_the_budget_takes_the_largest_batch_within():
    """A batch of B holds the memory and devices for its latency and serves B requests:
    a request's GB x s and device-hours are 1/B of the batch's. They fall while latency
    grows slower than the batch (the budget was read against the whole batch's cost,
    which grows, and a cost-slo deployment stopped at batch 3 where min-cost's showed
    4.5x batch 1's cost)."""
    from deploy_svc.planning import BudgetBatches, at_batch

    def budget_bound(*args):
        return BudgetBatches.of(*args).largest()

    _, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    batch1.cost_memory_latency = 1.0 * 0.4  # 1 GiB (taken as 1 GB here) for 0.4 s
    costs = {b: at_batch(batch1, batch2, b).cost_memory_latency for b in (1, 2, 4, 64)}
    for b, cost in costs.items():
        latency_s = (400 + (b - 1) * 110) / 1e3
        memory = (GIB + (b - 1) * (1 << 20)) / GIB
        assert cost == pytest.approx(memory * latency_s / b)
    assert costs[64] < costs[4] < costs[2] < costs[1]
    formula = common.COST_FORMULA_MEMORY_TIMES_LATENCY
    # Within the budget from batch 2 on, not at batch 1: the largest batch within it.
    assert budget_bound(batch1, batch2, formula, 0.26, 64).batch == 64
    # A budget that only batch 1 meets, and one none meets (batch 1, the fallback).
    growing = estimator_pb.ConfigEstimate()
    growing.CopyFrom(batch2)
    growing.latency_ms = 1200  # each more sequence adds more than batch 1's latency
    assert budget_bound(batch1, growing, formula, 0.45, 64).batch == 1
    assert budget_bound(batch1, growing, formula, 0.01, 64).batch == 1


def test_a_budget_no_configuration_meets_at_batch_1_is_met_by_the_smallest_batch_within():
    """Ranked at batch 1, a cost-slo intent whose budget only batching reaches fell back
    to min cost at a batch capped near batch 1's TTFT: every budget below a request's
    batch-1 cost was refused, though min-cost's own choice met it (a probe)."""
    from deploy_svc.planning import BudgetBatches, at_batch

    def budget_reach(*args):
        return BudgetBatches.of(*args).reach()

    config, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    batch1.cost_memory_latency = 0.4
    formula = common.COST_FORMULA_MEMORY_TIMES_LATENCY
    costs = {b: at_batch(batch1, batch2, b).cost_memory_latency for b in range(1, 65)}
    # 0.26 is first met at batch 2 (0.255): the smallest batch within, the fastest.
    first = min(b for b, c in costs.items() if c <= 0.26)
    assert budget_reach(batch1, batch2, formula, 0.26, 64).batch == first == 2
    # Met at no batch up to the bound: the cheapest batch.
    reach = budget_reach(batch1, batch2, formula, 0.01, 64)
    assert reach.batch == min(costs, key=costs.get) and "is met at no batch" in reach.reason
    # Through the deployer: the fallback option (it does not meet the intent) is sized
    # to the budget, past the TTFT cap a met budget keeps.
    nodes = _nodes(64)
    missed = "its estimated cost 0.4 GB*s is over the budget of 0.2 GB*s"
    fallback = planning.Option(1, config, batch1, meets_intent=False, shortfall=missed)
    prepared = dataclasses.replace(
        _prepared(nodes, [fallback]),
        cost_budget=(formula, 0.2),
        intent_kind=common.INTENT_KIND_COST_SLO,
    )
    decision = planning.decide_on(prepared, nodes)
    sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
    within = min(b for b, c in costs.items() if c <= 0.2)
    assert sized.config.batch_size == within > 2
    assert "the cost budget of 0.2" in sized.note and "met from this batch on" in sized.note
    # The ranking's shortfall is about the batch it ranked, and says so.
    assert f"is a fallback: {missed} (as ranked, at batch 1)" in sized.note
    assert sized.estimate.cost_memory_latency <= 0.2


def test_a_batch_s_per_device_memory_holds_its_share_of_the_extra_kv_cache():
    from deploy_svc.planning import at_batch

    _, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    batch1.config.tensor_parallel = 2
    batch1.memory_per_device_bytes = GIB // 2
    at_8 = at_batch(batch1, batch2, 8)
    assert at_8.memory_total_bytes == GIB + 7 * (1 << 20)
    assert at_8.memory_per_device_bytes == GIB // 2 + 7 * (1 << 19)


def test_a_throughput_intent_is_not_held_to_the_batch_1_tpot_without_a_tpot_objective():
    """max-throughput and min-device-hours stopped at the 1.5x-TPOT default: on a CPU,
    where batch 2's TPOT is 1.66x batch 1's, always at batch 1, 18 % below batch 2's
    estimated throughput (a probe). A TPOT objective still bounds them, and so does the
    KV cache that fits."""
    import dataclasses

    config, batch1, batch2 = _estimates(kv_bytes=1 << 20)
    nodes = _nodes(64)
    held = _prepared(nodes, [planning.Option(1, config, batch1)])
    free = dataclasses.replace(held, intent_kind=common.INTENT_KIND_MAX_THROUGHPUT)
    sizes = {}
    for name, prepared in (("held", held), ("free", free)):
        decision = planning.decide_on(prepared, nodes)
        sized = planning.size_batch(prepared, decision, nodes, batch1, batch2, prepared.objectives)
        sizes[name] = (sized.config.batch_size, sized.note)
    assert sizes["held"][0] == 6 and "1.5x the batch-1 TPOT" in sizes["held"][1]
    assert sizes["free"][0] == 64 and "an intent ranked by throughput" in sizes["free"][1]
    assert sizes["free"][1].endswith("batch 64: bounded by the cap of 64 (an intent ranked by "
                                     "throughput; no TPOT objective to keep)")  # fmt: skip
    slo = dataclasses.replace(_prepared(nodes, [planning.Option(1, config, batch1)], tpot_slo=30))
    slo = dataclasses.replace(slo, intent_kind=common.INTENT_KIND_MAX_THROUGHPUT)
    decision = planning.decide_on(slo, nodes)
    sized = planning.size_batch(slo, decision, nodes, batch1, batch2, slo.objectives)
    assert sized.config.batch_size == 6 and "TPOT SLO 30 ms" in sized.note
    small = _nodes(2.0)  # the KV cache of 5 sequences at most (256 MiB each)
    config, batch1, batch2 = _estimates(kv_bytes=256 << 20)
    tight = dataclasses.replace(
        _prepared(small, [planning.Option(1, config, batch1)]),
        intent_kind=common.INTENT_KIND_MAX_THROUGHPUT,
    )
    decision = planning.decide_on(tight, small)
    sized = planning.size_batch(tight, decision, small, batch1, batch2, tight.objectives)
    assert 1 < sized.config.batch_size < 6
    assert f"the KV cache of batch {sized.config.batch_size + 1} does not fit" in sized.note
