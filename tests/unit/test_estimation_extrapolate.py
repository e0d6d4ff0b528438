"""Layer extrapolation: per-layer and other terms from fingerprint samples."""

from __future__ import annotations

import numpy as np
import pytest

from services.estimation.extrapolate import (
    LatencySample,
    LayerLatency,
    fit_layer_latency,
    fit_layer_memory,
    fit_layer_memory_shared,
    fit_pooled_latency,
)

TRUE = LayerLatency(
    ttft_per_layer_s=0.004, ttft_other_s=0.010, tpot_per_layer_s=0.0007, tpot_other_s=0.0008
)


def end_to_end(
    terms: LayerLatency, layers: int, output_tokens: int, prompt="default"
) -> LatencySample:
    return LatencySample(layers, terms.latency(layers, output_tokens), output_tokens, prompt=prompt)


def test_four_end_to_end_points_solve_the_papers_system_exactly():
    samples = [end_to_end(TRUE, n, o) for n in (1, 2) for o in (10, 20)]
    fit = fit_layer_latency(samples).for_prompt()
    assert fit.ttft_per_layer_s == pytest.approx(0.004)
    assert fit.ttft_other_s == pytest.approx(0.010)
    assert fit.tpot_per_layer_s == pytest.approx(0.0007)
    assert fit.tpot_other_s == pytest.approx(0.0008)
    # Llama-2-7B has 32 layers: TTFT = 32 * 4 ms + 10 ms, TPOT = 32 * 0.7 ms + 0.8 ms.
    assert fit.ttft(32) == pytest.approx(0.138)
    assert fit.tpot(32) == pytest.approx(0.0232)
    assert fit.latency(32, 100) == pytest.approx(0.138 + 100 * 0.0232)


def test_direct_ttft_and_tpot_samples_mix_with_end_to_end_ones():
    samples = [
        LatencySample(1, TRUE.ttft(1), phase="ttft"),
        LatencySample(3, TRUE.ttft(3), phase="ttft"),
        LatencySample(1, TRUE.tpot(1), phase="tpot"),
        end_to_end(TRUE, 2, 50),
    ]
    fit = fit_layer_latency(samples).for_prompt()
    assert fit.ttft(80) == pytest.approx(TRUE.ttft(80))
    assert fit.tpot(80) == pytest.approx(TRUE.tpot(80))


def test_samples_with_another_prompt_share_tpot_but_not_ttft():
    short = LayerLatency(0.001, 0.002, TRUE.tpot_per_layer_s, TRUE.tpot_other_s)
    samples = [end_to_end(TRUE, n, o, "long") for n in (1, 2) for o in (10, 20)]
    samples += [end_to_end(short, n, o, "short") for n in (1, 2) for o in (10, 20)]
    fit = fit_layer_latency(samples)
    assert fit.for_prompt("long").ttft(32) == pytest.approx(TRUE.ttft(32))
    assert fit.for_prompt("short").ttft(32) == pytest.approx(short.ttft(32))
    assert fit.residual_rms_s == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(KeyError, match="no TTFT samples for prompt 'other'"):
        fit.for_prompt("other")


def test_fixed_per_layer_terms_leave_only_the_other_terms_to_fit():
    base = fit_layer_latency([end_to_end(TRUE, n, o) for n in (1, 2) for o in (10, 20)])
    staged = LayerLatency(TRUE.ttft_per_layer_s, 0.05, TRUE.tpot_per_layer_s, 0.002)
    fit = fit_layer_latency(
        [end_to_end(staged, 2, 10), end_to_end(staged, 2, 20)], fixed_per_layer=base
    )
    terms = fit.for_prompt()
    assert terms.ttft_other_s == pytest.approx(0.05)
    assert terms.tpot_other_s == pytest.approx(0.002)


def test_underdetermined_samples_are_rejected():
    with pytest.raises(ValueError, match="two layer counts"):
        fit_layer_latency([end_to_end(TRUE, 1, o) for o in (10, 20)])
    with pytest.raises(ValueError, match="two output lengths"):
        fit_layer_latency([end_to_end(TRUE, n, 10) for n in (1, 2)])
    with pytest.raises(ValueError, match="no latency samples"):
        fit_layer_latency([])
    with pytest.raises(ValueError, match="output_tokens >= 1"):
        LatencySample(1, 0.1)
    with pytest.raises(ValueError, match="phase must be one of"):
        LatencySample(1, 0.1, 10, phase="prefill")


def test_memory_is_linear_in_layers():
    line = fit_layer_memory([1, 2], [1.372, 1.771])
    assert line.per_layer_gib == pytest.approx(0.399)
    assert line.at(32) == pytest.approx(1.372 + 31 * 0.399)
    with pytest.raises(ValueError, match="two distinct layer counts"):
        fit_layer_memory([2, 2], [1.0, 1.1])


def test_layouts_share_one_memory_slope_and_keep_their_intercepts():
    groups = {
        (1, 1): ([1, 2], [1.4, 1.8]),
        (2, 1): ([1, 2], [2.9, 3.3]),
        (1, 2): ([2, 3], [2.7, 3.1]),
    }
    lines = fit_layer_memory_shared(groups)
    assert {round(line.per_layer_gib, 9) for line in lines.values()} == {0.4}
    assert lines[(2, 1)].at(1) == pytest.approx(2.9)
    assert lines[(1, 2)].at(32) == pytest.approx(2.7 + 30 * 0.4)


def test_a_trusted_group_sets_the_slope_when_other_groups_stray_from_it():
    mib = 1.0 / 1024
    # CPU int8 Falcon-style fingerprints: the follower ranks' figures moved by MiBs.
    groups = {
        (1, 1): ([1, 2], [7.03 * mib, 9.64 * mib]),
        (1, 2): ([2, 3], [11.14 * mib, 15.3 * mib]),
        (2, 1): ([1, 2], [18.1 * mib, 14.0 * mib]),
    }
    lines = fit_layer_memory_shared(groups, slope_from=(1, 1))
    assert lines[(1, 1)].per_layer_gib == pytest.approx(2.61 * mib)
    assert lines[(1, 1)].at(24) == pytest.approx((7.03 + 23 * 2.61) * mib)
    assert lines[(1, 2)].per_layer_gib == pytest.approx(2.61 * mib)
    # Without a trusted group the two positive slopes are averaged: 24 layers come out high.
    pooled = fit_layer_memory_shared(groups)
    assert pooled[(1, 1)].at(24) > 1.15 * lines[(1, 1)].at(24)


def test_groups_that_agree_with_the_trusted_one_are_still_pooled():
    groups = {
        (1, 1): ([1, 2], [1.4, 1.8]),
        (2, 1): ([1, 2], [2.9, 3.32]),
        (1, 2): ([2, 3], [2.7, 3.12]),
    }
    trusted = fit_layer_memory_shared(groups, slope_from=(1, 1))
    assert trusted[(1, 1)].per_layer_gib == pytest.approx(
        fit_layer_memory_shared(groups)[(1, 1)].per_layer_gib
    )
    assert trusted[(1, 1)].per_layer_gib > 0.4


def _pooled_truth(variant_layer_tpot, tp, pp, comm=0.0001, other=0.001):
    return LayerLatency(
        ttft_per_layer_s=0.004 / tp + (0.0005 if tp > 1 else 0.0),
        ttft_other_s=0.01 + 0.002 * (pp - 1),
        tpot_per_layer_s=variant_layer_tpot / tp + (comm if tp > 1 else 0.0),
        tpot_other_s=other + 0.0001 * (pp - 1),
    )


PER_VARIANT = {"fp16": 0.0007, "int4": 0.00025}


def _pooled_samples(rows_of) -> dict:
    """Samples of every variant of PER_VARIANT at (1,1), (2,1), (1,2): ``rows_of(truth,
    layers)`` gives a layout's samples from its true terms and fingerprint sizes."""
    samples = {}
    for name, layer_tpot in PER_VARIANT.items():
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            layers = (1, 2) if pp == 1 else (2, 3)
            samples[(name, (tp, pp))] = rows_of(_pooled_truth(layer_tpot, tp, pp), layers)
    return samples


def test_pooled_fit_recovers_shared_structure_across_variants_and_layouts():
    per_variant = PER_VARIANT
    samples = _pooled_samples(
        lambda truth, layers: [end_to_end(truth, n, o) for n in layers for o in (10, 20)]
    )
    fit = fit_pooled_latency(samples)
    assert fit.tpot_comm_per_layer_s[(2, 1)] == pytest.approx(0.0001)
    for name, layer_tpot in per_variant.items():
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            got = fit.layer_latency(name, (tp, pp), "default")
            want = _pooled_truth(layer_tpot, tp, pp)
            assert got.ttft(40) == pytest.approx(want.ttft(40))
            assert got.tpot(40) == pytest.approx(want.tpot(40))


def test_pooled_fit_needs_the_flat_layout_of_every_staged_one():
    samples = {("fp16", (1, 2)): [end_to_end(TRUE, n, o) for n in (2, 3) for o in (10, 20)]}
    with pytest.raises(ValueError, match=r"needs samples at \(1, 1\)"):
        fit_pooled_latency(samples)


def test_reference_extrapolation_rejects_what_it_cannot_use():
    from services.estimation.references import extrapolate_references

    samples = {("fp16", (1, 1)): [end_to_end(TRUE, n, o) for n in (1, 2) for o in (10, 20)]}
    memory = {("fp16", (1, 1)): ([1, 2], [1.4, 1.8])}
    profile = extrapolate_references(32, samples, memory)["fp16"]
    assert profile.layouts == ((1, 1), (2, 1), (1, 2))
    # No tp = 2 or pp = 2 fingerprints: overheads of zero, as Eq. 3 reads them.
    assert profile.ttft_s[1] == pytest.approx(profile.ttft_s[0] / 2)
    assert profile.tpot_s[2] == pytest.approx(profile.tpot_s[0])
    assert profile.at((1, 1))[2] == pytest.approx(1.4 + 31 * 0.4)
    with pytest.raises(ValueError, match="num_layers must be positive"):
        extrapolate_references(0, samples, memory)
    with pytest.raises(ValueError, match=r"samples of the \(1,1\) reference are required"):
        extrapolate_references(32, samples, {})
    with pytest.raises(ValueError, match="layouts must start with"):
        extrapolate_references(32, samples, memory, layouts=[(1, 1), (1, 2)])


def _per_layer_terms_match(fit):
    """(variant, tp, true terms, fitted terms) at (1,1) and (2,1) of every variant, each
    fitted pair's per-layer terms checked against the truth's."""
    for name, layer_tpot in PER_VARIANT.items():
        for tp in (1, 2):
            want = _pooled_truth(layer_tpot, tp, 1)
            got = fit.layer_latency(name, (tp, 1), "default")
            assert got.tpot_per_layer_s == pytest.approx(want.tpot_per_layer_s)
            assert got.ttft_per_layer_s == pytest.approx(want.ttft_per_layer_s)
            yield name, tp, want, got


def test_layer_clock_samples_set_the_per_layer_terms_and_counts_fit_the_rest():
    def rows_of(truth, layers):
        rows = []
        for n in layers:
            # The larger fingerprint ran on a slow moment: +8 % on every timing.
            slow = 1.08 if n == layers[1] else 1.0
            rows += [
                LatencySample(n, slow * truth.ttft(n), phase="ttft"),
                LatencySample(n, slow * truth.tpot(n), phase="tpot"),
                LatencySample(n, truth.ttft_per_layer_s, phase="ttft_layer"),
                LatencySample(n, truth.tpot_per_layer_s, phase="tpot_layer"),
            ]
        return rows

    samples = _pooled_samples(rows_of)
    clocked = fit_pooled_latency(samples)
    counted = fit_pooled_latency(
        {k: [s for s in v if s.phase in ("ttft", "tpot")] for k, v in samples.items()}
    )
    for name, tp, want, got in _per_layer_terms_match(clocked):
        # Extrapolated to 32 layers the clock stays within the slow run's 8 %; the
        # difference of the two fingerprints multiplies it.
        assert abs(got.tpot(32) / want.tpot(32) - 1) < 0.08
        bad = counted.layer_latency(name, (tp, 1), "default")
        assert abs(bad.tpot(32) / want.tpot(32) - 1) > 0.1


def test_a_forwards_cold_first_layer_lands_in_other_and_the_longer_stages_clocks_decide():
    """The worker's clock times a stage's layers after the first; a one-layer stage's
    clock is its first layer, which carries the forward's cold start (``cold``). The
    fit takes the per-layer terms from the longer fingerprints' clocks, and the cold
    start, paid once per forward, comes back in the "other" terms: a 32-layer model
    is estimated exactly. Taking the one-layer clocks too (the median of both), every
    layer would carry half of it."""
    cold_tpot, cold_ttft = 0.0003, 0.002

    def rows_of(truth, layers):
        rows = []
        for n in layers:
            rows += [
                # The end-to-end phases pay the cold start once per forward.
                LatencySample(n, truth.ttft(n) + cold_ttft, phase="ttft"),
                LatencySample(n, truth.tpot(n) + cold_tpot, phase="tpot"),
                LatencySample(
                    n, truth.ttft_per_layer_s + (cold_ttft if n == 1 else 0), phase="ttft_layer"
                ),
                LatencySample(
                    n, truth.tpot_per_layer_s + (cold_tpot if n == 1 else 0), phase="tpot_layer"
                ),
            ]
        return rows

    fit = fit_pooled_latency(_pooled_samples(rows_of))
    for _, _, want, got in _per_layer_terms_match(fit):
        assert got.tpot_other_s == pytest.approx(want.tpot_other_s + cold_tpot)
        assert got.ttft_other_s == pytest.approx(want.ttft_other_s + cold_ttft)
        assert got.tpot(32) == pytest.approx(want.tpot(32) + cold_tpot)
        assert got.ttft(32) == pytest.approx(want.ttft(32) + cold_ttft)


def test_layer_clock_samples_missing_for_a_layout_leave_the_counts_in_charge():
    truth = _pooled_truth(0.0007, 1, 1)
    two = _pooled_truth(0.0007, 2, 1)
    samples = {
        ("fp16", (1, 1)): [LatencySample(n, truth.tpot(n), phase="tpot") for n in (1, 2)]
        + [LatencySample(n, truth.ttft(n), phase="ttft") for n in (1, 2)]
        # A clock that disagrees with the counts, but (2,1) has none: not used.
        + [LatencySample(1, 0.5, phase="tpot_layer"), LatencySample(1, 0.5, phase="ttft_layer")],
        ("fp16", (2, 1)): [LatencySample(n, two.tpot(n), phase="tpot") for n in (1, 2)]
        + [LatencySample(n, two.ttft(n), phase="ttft") for n in (1, 2)],
    }
    fit = fit_pooled_latency(samples)
    assert fit.layer_latency("fp16", (1, 1), "default").tpot_per_layer_s == pytest.approx(0.0007)


def test_a_known_memory_slope_leaves_only_the_intercepts_to_the_samples():
    """With each layer's bytes known, noisy fingerprints fit only 'other': the
    synthetic truth (2.5 GiB per layer, 1.25 GiB other, +-0.01 GiB noise that a fitted
    slope would multiply by the layer count) comes back exactly in the slope and within
    the noise in the intercepts."""
    rng = np.random.default_rng(7)
    truth_slope, truth_other = {(1, 1): 2.5, (2, 1): 2.5}, {(1, 1): 1.25, (2, 1): 1.75}
    groups = {}
    for layout in truth_slope:
        layers = [1, 2, 1, 2]
        memory = [
            truth_slope[layout] * n + truth_other[layout] + rng.uniform(-0.01, 0.01) for n in layers
        ]
        groups[layout] = (layers, memory)
    fits = fit_layer_memory_shared(groups, slope_from=(1, 1), known_slope=2.5)
    for layout, fit in fits.items():
        assert fit.per_layer_gib == 2.5
        assert abs(fit.other_gib - truth_other[layout]) < 0.01
    with pytest.raises(ValueError, match="positive"):
        fit_layer_memory_shared(groups, known_slope=0.0)


# Communication per layer at each tensor degree (seconds): TTFT, TPOT.
LADDER_COMM = {2: (0.0005, 0.0001), 4: (0.0009, 0.0002), 8: (0.002, 0.0005)}
LADDER_VARIANTS = {"fp16": 0.0007, "int8": 0.0004, "int4": 0.00025}


def _ladder_truth(layer_tpot: float, tp: int, comm=LADDER_COMM) -> LayerLatency:
    ttft_comm, tpot_comm = comm.get(tp, (0.0, 0.0))
    return LayerLatency(
        ttft_per_layer_s=0.004 / tp + ttft_comm,
        ttft_other_s=0.01 + 0.005 * (tp - 1),
        tpot_per_layer_s=layer_tpot / tp + tpot_comm,
        tpot_other_s=0.001,
    )


def _ladder_samples(comm=LADDER_COMM, slow=None) -> dict:
    """End-to-end samples of every variant at (1,1) and (tp, 1) for each tp of ``comm``;
    ``slow`` = (variant, tp, seconds) adds that much to the variant's 2-layer runs there
    (one fingerprint timed badly)."""
    samples = {}
    for name, layer_tpot in LADDER_VARIANTS.items():
        for tp in (1, *comm):
            truth = _ladder_truth(layer_tpot, tp, comm)
            extra = slow[2] if slow and slow[:2] == (name, tp) else 0.0
            samples[(name, (tp, 1))] = [
                LatencySample(n, truth.latency(n, o) + (extra if n == 2 else 0.0), o)
                for n in (1, 2)
                for o in (10, 20)
            ]
    return samples


def test_ladder_communication_recovers_the_known_terms():
    fit = fit_pooled_latency(_ladder_samples())
    for tp, (ttft_comm, tpot_comm) in LADDER_COMM.items():
        assert fit.ttft_comm_per_layer_s[(tp, "default")] == pytest.approx(ttft_comm)
        assert fit.tpot_comm_per_layer_s[(tp, 1)] == pytest.approx(tpot_comm)
    for name, layer_tpot in LADDER_VARIANTS.items():
        got = fit.layer_latency(name, (8, 1), "default")
        want = _ladder_truth(layer_tpot, 8)
        assert got.ttft(80) == pytest.approx(want.ttft(80))
        assert got.tpot(80) == pytest.approx(want.tpot(80))


def test_one_badly_timed_variant_does_not_move_the_ladder_term_of_the_others():
    # int4's 2-layer fingerprint at tp = 8 ran 6 ms slow: its own per-layer TTFT reads
    # 6 ms high. A least-squares fit shared by the variants would put a third of that
    # on every variant's per-layer term (x 80 layers); the median over variants ignores it.
    fit = fit_pooled_latency(_ladder_samples(slow=("int4", 8, 0.006)))
    # (Within 1 %: the outlier still nudges the per-variant work the median is taken
    # against, through the joint fit; the mean would be 0.004, twice the truth.)
    assert fit.ttft_comm_per_layer_s[(8, "default")] == pytest.approx(LADDER_COMM[8][0], rel=0.01)
    got = fit.layer_latency("fp16", (8, 1), "default")
    assert got.ttft(80) == pytest.approx(
        _ladder_truth(LADDER_VARIANTS["fp16"], 8).ttft(80), rel=0.01
    )


def test_ladder_communication_is_no_less_than_the_tp2_all_reduce_over_more_peers():
    # Fingerprints at tp = 4 showing less communication per layer than tp = 2's: a ring
    # all-reduce moves 2 (tp - 1) / tp of its message per device, so the term is raised
    # to 1.5 x the tp = 2 one; tp = 8's (above its floor of 1.75 x) is left alone.
    comm = {2: (0.0005, 0.0001), 4: (0.0002, 0.00005), 8: (0.002, 0.0005)}
    fit = fit_pooled_latency(_ladder_samples(comm))
    assert fit.ttft_comm_per_layer_s[(2, "default")] == pytest.approx(0.0005)
    assert fit.ttft_comm_per_layer_s[(4, "default")] == pytest.approx(1.5 * 0.0005)
    assert fit.tpot_comm_per_layer_s[(4, 1)] == pytest.approx(1.5 * 0.0001)
    assert fit.ttft_comm_per_layer_s[(8, "default")] == pytest.approx(0.002)
    # The "other" terms are refitted around the raised per-layer term.
    got = fit.layer_latency("fp16", (4, 1), "default")
    assert got.ttft(1) == pytest.approx(_ladder_truth(0.0007, 4, comm).ttft(1), abs=0.001)


def _batched_clock_samples(batch_slowdown: float, second_batch: int = 2) -> dict:
    """Clocked samples of PER_VARIANT at (1,1) and (2,1), at batch 1 (prompt "b1") and
    batch ``second_batch`` (prompt "b2"), where the second label's decode layer and its
    'other' part take ``batch_slowdown`` times the first's."""
    samples = {}
    for name, layer_tpot in PER_VARIANT.items():
        for tp in (1, 2):
            one = _pooled_truth(layer_tpot, tp, 1)
            two = LayerLatency(
                one.ttft_per_layer_s * 1.5,
                one.ttft_other_s * 1.5,
                one.tpot_per_layer_s * batch_slowdown,
                one.tpot_other_s * batch_slowdown,
            )
            rows = []
            for truth, prompt, batch in ((one, "b1", 1), (two, "b2", second_batch)):
                for n in (1, 2):
                    rows += [
                        LatencySample(n, truth.ttft(n), phase="ttft", prompt=prompt, batch=batch),
                        LatencySample(n, truth.tpot(n), phase="tpot", prompt=prompt, batch=batch),
                        LatencySample(
                            n,
                            truth.ttft_per_layer_s,
                            phase="ttft_layer",
                            prompt=prompt,
                            batch=batch,
                        ),
                        LatencySample(
                            n,
                            truth.tpot_per_layer_s,
                            phase="tpot_layer",
                            prompt=prompt,
                            batch=batch,
                        ),
                    ]
            samples[(name, (tp, 1))] = rows
    return samples


def test_layer_clocks_keep_each_batch_size_its_own_decode_terms():
    # A batch-2 decode step costing 40 % more than a batch-1 one (what a CPU device
    # shows) must not move the batch-1 terms: one median over both batch sizes put the
    # batch-1 TPOT of the CPU bench's full models 10-17 % high.
    fit = fit_pooled_latency(_batched_clock_samples(1.4))
    for name, layer_tpot in PER_VARIANT.items():
        for tp in (1, 2):
            one = _pooled_truth(layer_tpot, tp, 1)
            got = fit.layer_latency(name, (tp, 1), "b1")
            assert got.tpot_per_layer_s == pytest.approx(one.tpot_per_layer_s)
            assert got.tpot(32) == pytest.approx(one.tpot(32))
            batch2 = fit.layer_latency(name, (tp, 1), "b2")
            assert batch2.tpot(32) == pytest.approx(1.4 * one.tpot(32))


def test_layer_clocks_keep_each_prompt_its_own_decode_terms():
    # Two prompt lengths at batch 1, the longer one's decode steps 1.8 times as long (they
    # read its whole context): each keeps its own TPOT. One median over both held a
    # hidden-256 model's TPOT at 1.2 ms for every prompt, against 1.04 ms measured after
    # 200 tokens and 1.87 after 1,024 (a probe).
    fit = fit_pooled_latency(_batched_clock_samples(1.8, second_batch=1))
    for name, layer_tpot in PER_VARIANT.items():
        for tp in (1, 2):
            short = _pooled_truth(layer_tpot, tp, 1)
            assert fit.layer_latency(name, (tp, 1), "b1").tpot(32) == pytest.approx(short.tpot(32))
            longer = fit.layer_latency(name, (tp, 1), "b2")
            assert longer.tpot(32) == pytest.approx(1.8 * short.tpot(32))


def test_end_to_end_timings_share_one_set_of_decode_terms_over_batch_sizes():
    # Without layer clocks (imported end-to-end data) the batch sizes pool their TPOT
    # samples, as on the A6000 data where batch-2 decode costs what batch 1 does.
    samples = {
        key: [s for s in rows if s.phase in ("ttft", "tpot")]
        for key, rows in _batched_clock_samples(1.0).items()
    }
    fit = fit_pooled_latency(samples)
    assert fit.batch_of("b1") == fit.batch_of("b2") == 1
    got = fit.layer_latency("fp16", (1, 1), "b1")
    assert got.tpot(32) == pytest.approx(_pooled_truth(PER_VARIANT["fp16"], 1, 1).tpot(32))


def test_a_prompt_label_at_two_batch_sizes_is_refused():
    truth = _pooled_truth(0.0007, 1, 1)
    samples = {
        ("fp16", (1, 1)): [
            LatencySample(n, truth.latency(n, o), o, batch=b)
            for n in (1, 2)
            for o in (10, 20)
            for b in (1, 2)
        ]
    }
    with pytest.raises(ValueError, match="several batch sizes"):
        fit_pooled_latency(samples)
    with pytest.raises(ValueError, match="batch must be at least 1"):
        LatencySample(1, 0.1, 10, batch=0)
