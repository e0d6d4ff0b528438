"""Scoring every configuration at once and ranking per intent."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from services.estimation.latency import ParallelConstants, PhaseConstants
from services.estimation.memory import MemoryConstants
from services.estimation.references import ReferenceProfile, VariantProfile
from services.estimation.score import Calibration, Intent, estimate_space, rank, unfit_note
from services.estimation.space import ModelShape, Variant, enumerate_space

SHAPE = ModelShape("toy", num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64)
LAYOUTS = ((1, 1), (2, 1), (1, 2))
LINEAR = PhaseConstants(ParallelConstants(0, 1, 0, 1), ParallelConstants(0, 1, 0, 1))


def profile(ttft: float, tpot: float, memory: float) -> VariantProfile:
    refs = ReferenceProfile(
        LAYOUTS,
        (ttft, ttft * 0.6, ttft),
        (tpot, tpot * 0.6, tpot),
        (memory, memory + 1, memory + 0.5),
    )
    return VariantProfile(refs)


def small_space(devices: int = 2, batches=(1,)):
    variants = (
        Variant("fp16", accuracy_pct=100.0),
        Variant("int4", weight_quant="int4", accuracy_pct=90.0),
    )
    profiles = [profile(0.1, 0.02, 12.0), profile(0.12, 0.008, 4.0)]
    return enumerate_space(SHAPE, devices, variants, batches), profiles


def with_batch2(
    profiles: list[VariantProfile], tpot_overhead: float, kv_tokens_profiled: int = 0
) -> list[VariantProfile]:
    """``profiles`` with a batch-2 profile whose decode costs ``tpot_overhead`` more."""
    return [
        VariantProfile(
            p.batch1,
            ReferenceProfile(
                LAYOUTS,
                p.batch1.ttft_s,
                tuple(t + tpot_overhead for t in p.batch1.tpot_s),
                p.batch1.memory_gib,
            ),
            kv_tokens_profiled=kv_tokens_profiled,
        )
        for p in profiles
    ]


def test_estimates_follow_the_models_by_hand():
    space, profiles = small_space()  # layouts (1,1), (1,2), (2,1) x 2 variants
    est = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=100)
    i = [space.describe(k) for k in range(space.size)].index("tp=2 pp=1 fp16 batch=1")
    # Reference layouts come back: TTFT 0.06, TPOT 0.012, memory 13 GiB.
    assert est.ttft_s[i] == pytest.approx(0.06)
    assert est.latency_s[i] == pytest.approx(0.06 + 99 * 0.012)
    assert est.memory_total_gib[i] == pytest.approx(13.0)
    assert est.memory_per_device_gib[i] == pytest.approx(6.5)
    assert est.cost_memory_latency[i] == pytest.approx(13.0 * est.latency_s[i])
    assert est.cost_device_hours[i] == pytest.approx(2 * est.latency_s[i] / 3600)
    assert est.throughput_tokens_per_s_per_device[i] == pytest.approx(100 / est.latency_s[i] / 2)
    assert est.accuracy_pct[i] == 100.0
    assert est.fits.all()


def test_batch_and_kv_cache_terms():
    space, profiles = small_space(devices=1, batches=(1, 4))
    two = with_batch2(profiles, tpot_overhead=0.001, kv_tokens_profiled=100)
    est = estimate_space(space, two, Calibration(LINEAR), output_tokens=10)
    kv_per_token_gib = SHAPE.kv_bytes_per_token() / 2**30
    b1, b4 = 0, 1  # fp16 at (1,1), batch 1 and 4
    assert est.tpot_s[b4] == pytest.approx(est.tpot_s[b1] + 3 * 0.001)
    assert est.memory_total_gib[b4] - est.memory_total_gib[b1] == pytest.approx(
        3 * 100 * kv_per_token_gib
    )
    deployed = estimate_space(space, two, Calibration(LINEAR), output_tokens=10, max_seq_len=2048)
    assert deployed.memory_total_gib[b4] == pytest.approx(
        12.0 + (4 * 2048 - 100) * kv_per_token_gib
    )


def test_decode_grows_with_the_batch_at_least_as_the_hardware_measured():
    """A batch-2 profile times a second sequence within its noise (the A6000's: about
    nothing), and a batch of 64 decoded as fast as one; the calibration's growth per
    further sequence (r x the batch-1 TPOT) is the floor of the profile's own."""
    space, profiles = small_space(devices=1, batches=(1, 64))
    two = with_batch2(profiles, tpot_overhead=0.0001)  # about nothing
    grown = Calibration(LINEAR, tpot_batch_growth=(("fp16", 1, 0.006), ("int4", 1, 0.5)))
    est = estimate_space(space, two, grown, output_tokens=10)
    named = [space.describe(k) for k in range(space.size)]
    fp16, int4 = named.index("tp=1 pp=1 fp16 batch=64"), named.index("tp=1 pp=1 int4 batch=64")
    # fp16: 0.02 x 0.006 = 0.00012 per sequence beats the profile's 0.0001.
    assert est.tpot_s[fp16] == pytest.approx(0.02 * (1 + 0.006 * 63))
    assert est.tpot_s[int4] == pytest.approx(0.008 * (1 + 0.5 * 63))
    at_one = named.index("tp=1 pp=1 fp16 batch=1")
    assert est.tpot_s[at_one] == pytest.approx(0.02)  # batch 1 untouched
    # A profile that measured more keeps its own; none measured at all: the floor alone.
    more = estimate_space(space, two, replace(grown, tpot_batch_growth=(("fp16", 1, 0.001),)), 10)
    assert more.tpot_s[fp16] == pytest.approx(0.02 + 63 * 0.0001)
    alone = estimate_space(space, profiles, grown, output_tokens=10)
    assert alone.tpot_s[fp16] == pytest.approx(0.02 * (1 + 0.006 * 63))
    flat = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=10)
    assert flat.tpot_s[fp16] == pytest.approx(0.02)
    # A pre-quantized format no sweep measured decodes as its bit width does.
    rates = Calibration(LINEAR, tpot_batch_growth=(("int4", 2, 0.02), ("int8", 2, 0.01)))
    weights = np.array(["int4_gptq", "int4", "int8", "fp16", "int4_gptq"], dtype=object)
    assert rates.batch_growth(weights, np.array([2, 2, 2, 2, 1])).tolist() == [
        0.02,
        0.02,
        0.01,
        0.0,
        0.0,
    ]


def test_the_kv_cache_a_deployment_adds_counts_the_heads_tensor_ranks_copy():
    """One KV head (multi-query) at tp = 2: each rank stores it, so every token the
    deployment adds beyond the profiled ones costs twice the unsharded K and V."""
    mqa = ModelShape("mqa", num_layers=8, num_heads=8, num_kv_heads=1, head_dim=64)
    variants = (Variant("fp16", accuracy_pct=100.0),)
    space = enumerate_space(mqa, 2, variants, (1,))
    profiles = [profile(0.1, 0.02, 12.0)]
    profiled = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=10)
    deployed = estimate_space(
        space, profiles, Calibration(LINEAR), output_tokens=10, max_seq_len=4096
    )
    per_token = mqa.kv_bytes_per_token() / 2**30
    tokens = 4096 - profiles[0].kv_tokens_profiled
    added = deployed.memory_total_gib - profiled.memory_total_gib
    for i in range(space.size):
        copies = int(space.tp[i])  # tp = 1 or 2, one KV head: a copy per rank
        assert added[i] == pytest.approx(copies * tokens * per_token), space.describe(i)


def test_every_intent_picks_what_it_should():
    space, profiles = small_space()
    est = estimate_space(space, profiles, Calibration(LINEAR, MemoryConstants()), output_tokens=100)

    def best(intent: Intent) -> str:
        return space.describe(rank(est, intent).best)

    assert best(Intent("min_latency")) == "tp=2 pp=1 int4 batch=1"
    assert best(Intent("min_memory")) == "tp=1 pp=1 int4 batch=1"
    # int4 at (2,1): 5 GiB x (0.072 + 100 x 0.0048) s = 2.76 GiB*s beats (1,1): 4 x 0.92.
    assert best(Intent("min_cost")) == "tp=2 pp=1 int4 batch=1"
    assert best(Intent("min_device_hours")) == "tp=1 pp=1 int4 batch=1"
    assert best(Intent("max_throughput")) == "tp=1 pp=1 int4 batch=1"
    assert best(Intent("min_latency", accuracy_floor_pct=95)) == "tp=2 pp=1 fp16 batch=1"
    # Under a 1.0 s SLO only int4 layouts remain; the cheapest of them wins.
    slo = rank(est, Intent("latency_slo", latency_slo_s=1.0))
    assert all(space.variants[space.variant[k]].name == "int4" for k in slo.indices)
    assert space.describe(slo.best) == "tp=2 pp=1 int4 batch=1"
    budget = rank(est, Intent("cost_slo", cost_budget=5.0))
    assert np.all(est.cost_memory_latency[budget.indices] <= 5.0)
    assert budget.best == int(budget.indices[np.argmin(est.latency_s[budget.indices])])


def test_fallbacks_are_explained():
    space, profiles = small_space()
    est = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=100)
    slo = rank(est, Intent("latency_slo", latency_slo_s=0.01))
    assert "no configuration meets the latency SLO of 0.01 s" in slo.notes[0]
    assert slo.best == rank(est, Intent("min_latency")).best
    budget = rank(est, Intent("cost_slo", cost_budget=0.001))
    assert "falling back to minimum cost" in budget.notes[0]
    assert budget.best == rank(est, Intent("min_cost")).best
    # A floor is applied as given (the fallback is services.intents'): nobody reaches it.
    floor = rank(est, Intent("min_memory", accuracy_floor_pct=101))
    assert "no configuration that fits reaches the accuracy floor of 101 %" in floor.notes[0]
    assert floor.indices.size == 0 and floor.best is None


def test_configurations_that_do_not_fit_are_left_out():
    space, profiles = small_space()
    est = estimate_space(
        space, profiles, Calibration(LINEAR), output_tokens=100, device_memory_gib=6.6
    )
    ranking = rank(est, Intent("min_latency"))
    assert np.all(est.memory_per_device_gib[ranking.indices] <= 6.6)
    unfit = int(np.count_nonzero(est.estimable & ~est.fits))
    assert unfit >= 1 and ranking.notes[0] == unfit_note(unfit)
    nothing = estimate_space(
        space, profiles, Calibration(LINEAR), output_tokens=100, device_memory_gib=0.1
    )
    empty = rank(nothing, Intent())
    assert empty.best is None and "no configuration fits" in empty.notes[-1]
    # It says how far off the closest configuration is, and which one that is.
    least = int(np.argmin(nothing.memory_per_device_gib))
    tp, pp = int(space.tp[least]), int(space.pp[least])
    assert empty.notes[-1].startswith(
        "no configuration fits the device memory: the least any needs is "
        f"{nothing.memory_per_device_gib[least]:.1f} GiB per device ("
        f"{space.variants[space.variant[least]].name} at tp={tp} pp={pp}, {tp * pp} device"
        + ("s)" if tp * pp > 1 else ")")
    )


def test_what_the_deployer_reserves_is_what_nothing_fitting_names():
    """With ``fits`` judged as the deployer reserves (estimator_svc.service.reserved_fits),
    the least need named is that reservation: the estimate's own 6.5 GiB on a 6.6 GiB
    device read as fitting beside "nothing fits" (a tester's 33.8 GiB on 34)."""
    import dataclasses

    space, profiles = small_space()
    est = estimate_space(
        space, profiles, Calibration(LINEAR), output_tokens=100, device_memory_gib=1e6
    )
    reserved = est.memory_per_device_gib + 7.0
    judged = dataclasses.replace(est, fits=reserved <= 6.6, reserved_per_device_gib=reserved)
    empty = rank(judged, Intent())
    least = int(np.argmin(reserved))
    assert empty.best is None
    assert empty.notes[-1].startswith(
        "no configuration fits the device memory: the least any needs is "
        f"{reserved[least]:.1f} GiB per device as the deployer reserves it ("
    ), empty.notes[-1]


def test_configurations_without_a_usable_estimate_are_never_ranked():
    space, profiles = small_space()
    est = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=100)
    assert est.estimable.all() and est.unestimable_note() is None
    # Noisy fingerprints: an undefined memory, a non-positive TPOT.
    fastest = rank(est, Intent("min_latency")).best
    est.tpot_s[fastest] = -0.001
    est.memory_total_gib[0] = np.nan
    left_out = {0, fastest}
    assert set(np.flatnonzero(~est.estimable)) == left_out
    ranking = rank(est, Intent("min_latency"))
    assert not left_out & set(ranking.indices.tolist())
    assert ranking.indices.size == space.size - len(left_out)
    assert ranking.notes[0].startswith(f"{len(left_out)} configurations left out: their")
    est.ttft_s[:] = 0.0
    empty = rank(est, Intent("min_cost"))
    assert empty.best is None and empty.notes[-1] == "no configuration has a usable estimate"


def test_bad_requests_say_what_is_wrong():
    space, profiles = small_space()
    with pytest.raises(ValueError, match="unknown intent"):
        Intent("cheapest")
    with pytest.raises(ValueError, match="latency_slo_s"):
        Intent("latency_slo")
    with pytest.raises(ValueError, match="cost_budget"):
        Intent("cost_slo", cost_budget=0)
    with pytest.raises(ValueError, match="1 profiles for 2 variants"):
        estimate_space(space, profiles[:1], Calibration(LINEAR), 10)
    with pytest.raises(ValueError, match="output_tokens"):
        estimate_space(space, profiles, Calibration(LINEAR), 0)


def test_latency_counts_a_tpot_for_every_token_after_the_first():
    # The first token comes out of the prefill (TTFT); each other takes one decode step,
    # as the profiler's and the scheduler's stream timings count them.
    space, profiles = small_space()
    for output_tokens in (1, 2, 16):
        est = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=output_tokens)
        np.testing.assert_allclose(est.latency_s, est.ttft_s + (output_tokens - 1) * est.tpot_s)


def test_phases_split_from_end_to_end_latency_count_every_token_as_a_tpot():
    # MaverIQ-style references (L = TTFT + N * TPOT) keep their latency; the TTFT an
    # estimate reports is the first token's arrival, one TPOT after the split's TTFT.
    space, profiles = small_space()
    split = [VariantProfile(p.batch1, p.batch2, p.kv_tokens_profiled, True) for p in profiles]
    streamed = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=16)
    est = estimate_space(space, split, Calibration(LINEAR), output_tokens=16)
    np.testing.assert_allclose(est.latency_s, streamed.ttft_s + 16 * streamed.tpot_s)
    np.testing.assert_allclose(est.ttft_s, streamed.ttft_s + streamed.tpot_s)
    np.testing.assert_allclose(est.latency_s, est.ttft_s + 15 * est.tpot_s)


def test_the_kv_cache_is_sized_in_the_dtype_the_profile_was_stored_in():
    # Profiled in float32 (a CPU): each token's K and V take twice the 16-bit figure,
    # and a deployment's cache is charged at that size.
    space, profiles = small_space(devices=1)
    fp32 = 2 * SHAPE.kv_bytes_per_token() / 2**30
    stored = [replace(p, kv_tokens_profiled=100, kv_gib_per_token=fp32) for p in profiles]
    profiled = estimate_space(space, stored, Calibration(LINEAR), output_tokens=10)
    deployed = estimate_space(
        space, stored, Calibration(LINEAR), output_tokens=10, max_seq_len=2048
    )
    np.testing.assert_allclose(
        deployed.memory_total_gib - profiled.memory_total_gib, (2048 - 100) * fp32
    )
    np.testing.assert_allclose(deployed.kv_cache_gib, 2048 * fp32)
    # Unknown (0): the architecture's 16-bit figure.
    unknown = estimate_space(
        space, profiles, Calibration(LINEAR), output_tokens=10, max_seq_len=2048
    )
    np.testing.assert_allclose(unknown.kv_cache_gib, 2048 * fp32 / 2)


def test_a_small_models_least_need_is_said_in_mib():
    """A need under 1 GiB read "0.0 GiB per device"."""
    from services.estimation.score import _nothing_fits

    space, profiles = small_space()
    est = estimate_space(space, profiles, Calibration(LINEAR), output_tokens=100)
    est.memory_per_device_gib[:] = 0.0123
    said = _nothing_fits(est)
    assert "the least any needs is 13 MiB per device (" in said
    # One device is one ("1 devices", a probe).
    assert said.endswith(", 1 device)"), said  # the first estimable is tp = pp = 1
