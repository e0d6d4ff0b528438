"""Memory model (M2 + hardware terms) and latency model (Eq. 2, Eq. 3, batch) by hand."""

from __future__ import annotations

import numpy as np
import pytest

from services.estimation.latency import (
    O_PP_FROM_BASE,
    ParallelConstants,
    PhaseConstants,
    ReferenceScales,
    latency_at_batch,
    parallel_latency,
    parallel_overheads,
    phase_latency,
)
from services.estimation.memory import (
    MemoryConstants,
    kv_cache_gib,
    kv_replication,
    per_device_memory_gib,
    solve_memory_components,
    total_memory_gib,
)
from services.estimation.space import ModelShape

LAYOUTS = [(1, 1), (1, 2), (1, 8), (2, 1), (2, 4), (4, 1), (4, 2), (8, 1)]


def test_papers_memory_model_by_hand():
    parts = solve_memory_components(13.6, 15.2, 14.5)  # mem(1,1), mem(2,1), mem(1,2)
    assert parts.activations_gib == pytest.approx(1.6)
    assert parts.weights_gib == pytest.approx(12.0)
    assert parts.pipeline_activations_gib == pytest.approx(0.9)
    # mem(tp, pp) = W + A + (tp - 1) A + tp (pp - 1) A_p
    assert total_memory_gib(parts, 8, 1) == pytest.approx(12.0 + 8 * 1.6)
    assert total_memory_gib(parts, 2, 4) == pytest.approx(12.0 + 2 * 1.6 + 2 * 3 * 0.9)


@pytest.mark.parametrize(
    "constants",
    [
        MemoryConstants(),
        MemoryConstants(tp_peer_gib=0.28),
        MemoryConstants(0.4, (((1, 1), 0.3), ((2, 1), -0.2), ((1, 2), 0.5), ((8, 1), 1.0))),
    ],
)
def test_solved_components_reproduce_the_references_exactly(constants):
    refs = np.array([[13.6, 15.2, 14.5], [4.5, 6.2, 5.4]])
    parts = solve_memory_components(refs[:, 0], refs[:, 1], refs[:, 2], constants)
    for column, (tp, pp) in enumerate(((1, 1), (2, 1), (1, 2))):
        np.testing.assert_allclose(total_memory_gib(parts, tp, pp, constants), refs[:, column])


def test_peer_overhead_grows_with_the_tp_group():
    constants = MemoryConstants(tp_peer_gib=0.25)
    parts = solve_memory_components(13.6, 15.2, 14.5, constants)
    # A = 15.2 - 13.6 - 2 * 0.25 (the peer term of (2,1)), W = 13.6 - A
    assert parts.activations_gib == pytest.approx(1.1)
    assert total_memory_gib(parts, 8, 1, constants) == pytest.approx(12.5 + 8 * 1.1 + 0.25 * 8 * 7)
    plain = total_memory_gib(solve_memory_components(13.6, 15.2, 14.5), 8, 1)
    assert total_memory_gib(parts, 8, 1, constants) > plain + 5


def test_layout_residual_applies_to_its_layout_only():
    constants = MemoryConstants(0.0, (((8, 1), 2.0),))
    parts = solve_memory_components(13.6, 15.2, 14.5, constants)
    tp = np.array([8, 4, 1])
    pp = np.array([1, 2, 8])
    got = total_memory_gib(parts, tp, pp, constants)
    plain = total_memory_gib(parts, tp, pp)
    np.testing.assert_allclose(got - plain, [2.0, 0.0, 0.0])


def test_per_device_memory_and_kv_cache():
    assert per_device_memory_gib(40.0, 2, 4) == pytest.approx(5.0)
    llama = ModelShape("llama-2-7b", 32, 32, 32, 128)
    # 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token; 4096 tokens x 2 = 4 GiB
    assert kv_cache_gib(llama, 4096, 2) == pytest.approx(4.0)
    assert kv_cache_gib(llama, 4096, 2, "int8") == pytest.approx(2.0)
    # Sharded, not copied, wherever tp divides the KV heads: the total is the layout's.
    assert kv_cache_gib(llama, 4096, 2, tp=8) == pytest.approx(4.0)
    # A model with 2 KV heads at tp = 8: each rank holds a whole head, 8 heads in all,
    # 4 times the unsharded cache (the total reported once ignored the copies).
    two = ModelShape("gqa-2", 32, 32, 2, 128)
    np.testing.assert_allclose(kv_replication(2, np.array([1, 2, 4, 8])), [1, 1, 2, 4])
    assert kv_cache_gib(two, 4096, 2, tp=8) == pytest.approx(4 * kv_cache_gib(two, 4096, 2))
    assert kv_replication(1, 8) == pytest.approx(8.0)  # multi-query


def test_equation_two_by_hand():
    c = ParallelConstants(alpha=0.1, beta=0.7, gamma=0.5, delta=0.6)
    l11, l21, l12 = 2.4, 1.4, 2.35
    o_tp, o_pp = parallel_overheads(l11, l21, l12, c)
    assert o_tp == pytest.approx(1.4 - 1.2)
    assert o_pp == pytest.approx(2.35 - 2.4 / 2**0.1)
    got = parallel_latency(l11, l21, l12, 4, 2, c)
    want = 2.4 / (4 * 2**0.1) + 3**0.7 / 2**0.5 * o_tp + 1**0.6 * o_pp
    assert got == pytest.approx(want)
    # The references come back: (1,1) exactly, (2,1) and (1,2) by construction of O_TP, O_PP.
    np.testing.assert_allclose(
        parallel_latency(l11, l21, l12, np.array([1, 2, 1]), np.array([1, 1, 2]), c),
        [l11, l21, l12],
    )


def test_maveriq_code_variant_takes_o_pp_from_the_base_and_clamps():
    c = ParallelConstants(alpha=0.2, beta=1.0, gamma=0.0, delta=1.0)
    _, o_pp = parallel_overheads(2.0, 1.2, 9.9, c, O_PP_FROM_BASE)
    assert o_pp == pytest.approx(2.0 - 2.0 / 2**0.2)
    # O_TP = 0.9 - 1.0 < 0: MaverIQ's code clips it, iserve keeps it.
    clipped = parallel_latency(2.0, 0.9, 2.0, 2, 1, c, clamp_overheads=True)
    assert clipped == pytest.approx(1.0)
    assert parallel_latency(2.0, 0.9, 2.0, 2, 1, c) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="o_pp_from"):
        parallel_overheads(1, 1, 1, c, "elsewhere")


def test_tp_ladder_replaces_the_extrapolated_overhead_where_measured():
    c = ParallelConstants(alpha=0.0, beta=1.0, gamma=1.0, delta=1.0)
    tp = np.array([4, 8, 8])
    pp = np.array([1, 1, 2])
    ladder = {8: np.array([5.0, 5.0, np.nan])}
    got = parallel_latency(2.0, 1.5, 2.0, tp, pp, c, tp_ladder=ladder)
    # tp = 4: extrapolated 2/4 + 3 * 0.5; tp = 8: measured 5.0; NaN falls back to
    # 2 / (8 * 2**0) + 7 * 0.5 / 2**1 (alpha = 0, and O_PP = 2 - 2 = 0).
    np.testing.assert_allclose(got, [0.5 + 1.5, 5.0, 2.0 / 8 + 7 * 0.5 / 2])


def test_an_extrapolated_tp_overhead_never_speeds_a_layout_up():
    """O_TP < 0 (L(2,1) under half of L(1,1), within timing noise) reproduces L(2,1) at
    tp = 2 but is not multiplied into a speed-up beyond it; a measured ladder stands."""
    c = ParallelConstants(alpha=0.0, beta=1.5, gamma=0.0, delta=1.0, tp_ratio=((8, 9.0),))
    l11, l21 = 120.0, 58.0  # O_TP = -2
    tp = np.array([2, 4, 8, 8])
    pp = np.array([1, 1, 1, 2])
    got = parallel_latency(l11, l21, l11, tp, pp, c)
    # alpha = 0 and L(1,2) = L(1,1): a second stage changes nothing (O_PP = 0).
    np.testing.assert_allclose(got, [58.0, 30.0, 15.0, 15.0])
    # Unclamped, tp = 8 would have been 15 + 9 * (-2) = -3 s.
    ladder = {8: np.array([14.0, 14.0, 14.0, 14.0])}
    got = parallel_latency(l11, l21, l11, tp, pp, c, tp_ladder=ladder)
    np.testing.assert_allclose(got[2], 14.0)


def test_phases_compose_and_scales_apply_to_the_references_only():
    constants = PhaseConstants(ParallelConstants(0, 1, 0, 1), ParallelConstants(0, 1, 0, 1))
    ttft_refs = np.array([0.1, 0.06, 0.1])
    tpot_refs = np.array([0.02, 0.012, 0.02])
    ttft, tpot, latency = phase_latency(ttft_refs, tpot_refs, 2, 1, 100, constants)
    assert (ttft, tpot) == (pytest.approx(0.06), pytest.approx(0.012))
    assert latency == pytest.approx(0.06 + 100 * 0.012)
    scaled_ttft, scaled_tpot = ReferenceScales((2.0, 1.0, 1.0), (1.0, 1.0, 0.5)).apply(
        np.array([0.1, 0.06, 0.1, 0.3]), tpot_refs
    )
    np.testing.assert_allclose(scaled_ttft, [0.2, 0.06, 0.1, 0.3])
    np.testing.assert_allclose(scaled_tpot, [0.02, 0.012, 0.01])


def test_batch_model_is_linear_in_batch():
    np.testing.assert_allclose(latency_at_batch(2.0, 0.01, np.array([1, 2, 64])), [2.0, 2.01, 2.63])
    with pytest.raises(ValueError):
        latency_at_batch(2.0, 0.01, 0)
