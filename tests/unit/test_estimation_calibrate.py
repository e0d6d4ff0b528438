"""Calibration recovers known constants from synthetic data, deterministically."""

from __future__ import annotations

import numpy as np
import pytest

from services.estimation.calibrate import (
    calibrate_latency,
    calibrate_memory_constants,
    calibrate_parallel_constants,
    fit_reference_scales,
    fit_tp_ratios,
    mape_pct,
    minimize_mape,
)
from services.estimation.latency import (
    REFERENCE_LAYOUTS,
    ParallelConstants,
    PhaseConstants,
    parallel_latency,
    phase_latency,
)
from services.estimation.memory import MemoryConstants, solve_memory_components, total_memory_gib

PAIRS = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]


def synthetic_rows(seed: int = 0):
    """Three 'models' x every layout: references and layouts as calibration rows."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.5, 3.0, size=6)
    refs = np.stack(
        [base, base * rng.uniform(0.55, 0.7, 6), base * rng.uniform(0.97, 1.0, 6)], axis=1
    )
    rows = [(refs[i], tp, pp) for i in range(6) for tp, pp in PAIRS]
    return (
        np.array([r for r, _, _ in rows]),
        np.array([tp for _, tp, _ in rows], float),
        np.array([pp for _, _, pp in rows], float),
    )


def test_mape_and_its_guards():
    assert mape_pct(np.array([1.1, 0.9]), np.array([1.0, 1.0])) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="positive"):
        minimize_mape(lambda p: p, np.array([0.0]), [np.array([1.0])], np.zeros(1), np.ones(1))
    with pytest.raises(ValueError, match="no measurements"):
        minimize_mape(lambda p: p, np.array([]), [np.array([1.0])], np.zeros(1), np.ones(1))


def test_gradient_descent_recovers_known_exponents():
    refs, tp, pp = synthetic_rows()
    truth = ParallelConstants(alpha=0.1, beta=1.3, gamma=0.4, delta=0.6)
    measured = parallel_latency(refs[:, 0], refs[:, 1], refs[:, 2], tp, pp, truth)
    fitted, fit = calibrate_parallel_constants(refs, tp, pp, measured, steps=300)
    assert fit.mape_pct < 0.5
    np.testing.assert_allclose(fitted.as_array(), truth.as_array(), atol=0.08)


def test_calibration_is_deterministic():
    refs, tp, pp = synthetic_rows(1)
    truth = ParallelConstants(0.05, 0.8, 0.5, 1.0)
    measured = parallel_latency(refs[:, 0], refs[:, 1], refs[:, 2], tp, pp, truth)
    first = calibrate_parallel_constants(refs, tp, pp, measured, steps=60)
    second = calibrate_parallel_constants(refs, tp, pp, measured, steps=60)
    assert first == second


def test_phase_calibration_recovers_ttft_and_tpot_exponents_and_scales():
    refs, tp, pp = synthetic_rows(2)
    truth = PhaseConstants(
        ParallelConstants(0.2, 1.6, 0.1, 0.4), ParallelConstants(0.05, 0.6, 0.5, 0.6)
    )
    ttft_refs, tpot_refs = refs * 0.1, refs * 0.01
    out = np.tile([10.0, 100.0], len(tp) // 2 + 1)[: len(tp)]
    ttft, tpot, latency = phase_latency(ttft_refs, tpot_refs, tp, pp, out, truth)
    # The extrapolated references undershoot the truth by 4 % (TTFT) and 2 % (TPOT).
    constants, scales, fit = calibrate_latency(
        ttft_refs / 1.04, tpot_refs / 1.02, tp, pp, out, latency, ttft, tpot, steps=200
    )
    assert scales.ttft == pytest.approx((1.04, 1.04, 1.04))
    assert scales.tpot == pytest.approx((1.02, 1.02, 1.02))
    assert fit.mape_pct < 1.0
    # tp = 4 and 8 take the measured ladder, here the power law's own values; beta then
    # only reaches tp = 2, where (2 - 1)**beta = 1 whatever it is.
    for phase in ("ttft", "tpot"):
        fitted, true = getattr(constants, phase), getattr(truth, phase)
        assert dict(fitted.tp_ratio) == pytest.approx({4: 3**true.beta, 8: 7**true.beta})
    alpha_gamma_delta = [0, 2, 3]
    np.testing.assert_allclose(
        constants.tpot.as_array()[alpha_gamma_delta],
        truth.tpot.as_array()[alpha_gamma_delta],
        atol=0.1,
    )


def test_the_hardware_tp_ladder_is_recovered_where_no_power_law_fits():
    """A PCIe box whose tp = 8 overhead is 4.9 times tp = 2's while tp = 4 is 1.8 times
    (no beta gives both): fit_tp_ratios recovers the table exactly from synthetic full
    models, and a calibration with it reproduces every layout."""
    refs, tp, pp = synthetic_rows(3)
    truth = ParallelConstants(0.1, 0.7, 0.4, 0.6, tp_ratio=((4, 1.8), (8, 4.9)))
    measured = parallel_latency(refs[:, 0], refs[:, 1], refs[:, 2], tp, pp, truth)
    assert dict(fit_tp_ratios(refs, tp, pp, measured)) == pytest.approx({4: 1.8, 8: 4.9})
    out = np.full(len(tp), 50.0)
    constants, _, fit = calibrate_latency(
        refs,
        refs * 0.1,
        tp,
        pp,
        out,
        measured + out * measured * 0.1,
        measured,
        measured * 0.1,
        steps=150,
        scale_references=False,
    )
    assert dict(constants.tpot.tp_ratio) == pytest.approx({4: 1.8, 8: 4.9})
    assert fit.mape_pct < 1.0
    power_law = ParallelConstants(0.1, 0.7, 0.4, 0.6)
    without = parallel_latency(refs[:, 0], refs[:, 1], refs[:, 2], tp, pp, power_law)
    eight = tp == 8
    assert mape_pct(without[eight], measured[eight]) > 10.0  # what the table is for


def test_reference_scales_default_to_one_without_data_at_a_reference():
    refs = np.ones((2, 3))
    scales = fit_reference_scales(
        refs, refs, np.array([4, 8]), np.array([1, 1]), np.ones(2), np.ones(2)
    )
    assert scales.ttft == (1.0, 1.0, 1.0)
    assert REFERENCE_LAYOUTS == ((1, 1), (2, 1), (1, 2))


def test_memory_calibration_recovers_the_peer_overhead_and_layout_residuals():
    rng = np.random.default_rng(3)
    rows = []
    truth = MemoryConstants(tp_peer_gib=0.3, layout_residual_gib=(((1, 4), 0.5),))
    for weights in rng.uniform(4, 40, size=5):
        plain = solve_memory_components(weights + 1.0, weights + 2.0, weights + 1.9)
        for tp, pp in PAIRS:
            measured = total_memory_gib(plain, tp, pp, truth)
            refs = [float(total_memory_gib(plain, t, p, truth)) for t, p in REFERENCE_LAYOUTS]
            rows.append((refs, tp, pp, float(measured)))
    refs = np.array([r for r, *_ in rows])
    tp = np.array([r[1] for r in rows], float)
    pp = np.array([r[2] for r in rows], float)
    measured = np.array([r[3] for r in rows])
    constants, fit = calibrate_memory_constants(refs, tp, pp, measured, steps=200)
    assert constants.tp_peer_gib == pytest.approx(0.3, abs=0.01)
    residuals = dict(constants.layout_residual_gib)
    assert residuals[(1, 4)] == pytest.approx(0.5, abs=0.05)
    assert abs(residuals[(8, 1)]) < 0.1
    assert fit.mape_pct < 0.2


def test_memory_calibration_keeps_no_peer_term_the_data_cannot_identify():
    # Only the reference layouts measured (a 2-device CPU node): the references reproduce
    # tp = 1 and 2 exactly whatever the per-peer term is, so it stays 0.
    plain = solve_memory_components(5.0, 6.2, 5.9)
    rows = [(1, 1), (2, 1), (1, 2)]
    refs = np.array([[5.0, 6.2, 5.9]] * len(rows))
    tp = np.array([t for t, _ in rows], float)
    pp = np.array([p for _, p in rows], float)
    measured = np.array([float(total_memory_gib(plain, t, p)) + 0.01 for t, p in rows])
    constants, fit = calibrate_memory_constants(refs, tp, pp, measured, steps=50)
    assert constants.tp_peer_gib == 0.0
    assert fit.mape_pct < 0.5


def _format_rows(departure: dict[str, dict[str, float]], model_factor: dict[str, float]):
    """Rows at (1,1) of every model x weight format x 5 outputs: measured = reference x
    the model's own factor x the format's departure on that model (TPOT; TTFT exact)."""
    models, weights, ttft_refs, tpot_refs, ttft, tpot = [], [], [], [], [], []
    for model, factor in model_factor.items():
        for weight, by_model in departure.items():
            for i in range(5):
                ref = 0.01 + 0.001 * i
                models.append(model)
                weights.append(weight)
                ttft_refs.append([0.1, 0.06, 0.1])
                tpot_refs.append([ref, ref * 0.6, ref])
                ttft.append(0.1)
                tpot.append(ref * factor * by_model[model])
    n = len(models)
    return dict(
        ttft_refs=np.array(ttft_refs),
        tpot_refs=np.array(tpot_refs),
        tp=np.ones(n),
        pp=np.ones(n),
        measured_ttft=np.array(ttft),
        measured_tpot=np.array(tpot),
        weights=np.array(weights, dtype=object),
        models=np.array(models, dtype=object),
    )


def test_a_weight_format_that_departs_the_same_way_on_every_model_gets_its_own_scale():
    # int8 runs 15 % above its model's median and fp16 below, on both models (what a CPU
    # shows for an int8 kernel whose fingerprint weights stay in cache); the models' own
    # factors agree to 1 %.
    rows = _format_rows(
        {"int8": {"a": 1.15, "b": 1.15}, "fp16": {"a": 1 / 1.15, "b": 1 / 1.15}},
        {"a": 1.0, "b": 1.02},
    )
    scales = fit_reference_scales(**rows)
    ttft, tpot = scales.factors("int8")
    assert ttft == scales.ttft  # no TTFT departure: the all-format factors
    # Each model's median over its rows sits between the formats; int8 is 15 % above it.
    assert tpot[0] / scales.tpot[0] == pytest.approx(1.15, rel=0.02)
    assert scales.factors("fp16")[1][0] / scales.tpot[0] == pytest.approx(1 / 1.15, rel=0.02)
    assert scales.factors("int4") == (scales.ttft, scales.tpot)  # not calibrated: all-format
    # Applied per row: an int8 and an fp16 row of the same references scale apart.
    refs = np.array([[0.01, 0.006, 0.01]] * 2)
    _, scaled = scales.apply(refs, refs, np.array(["int8", "fp16"], dtype=object))
    assert scaled[0, 0] / scaled[1, 0] == pytest.approx(1.15**2, rel=0.03)
    # Without the formats the rows share one factor.
    plain = fit_reference_scales(
        **{k: v for k, v in rows.items() if k not in ("weights", "models")}
    )
    assert plain.by_weight == ()


def test_a_format_departure_that_flips_between_models_or_hides_in_their_spread_is_dropped():
    flips = _format_rows(
        {"int8": {"a": 1.1, "b": 0.9}, "fp16": {"a": 1 / 1.1, "b": 1 / 0.9}},
        {"a": 1.0, "b": 1.0},
    )
    assert fit_reference_scales(**flips).by_weight == ()
    # 3 % the same way on every model, but the models' own factors differ by 30 %.
    small = _format_rows(
        {"int4": {m: 1.03 for m in "abc"}, "fp16": {m: 1 / 1.03 for m in "abc"}},
        {"a": 0.85, "b": 1.0, "c": 1.15},
    )
    assert fit_reference_scales(**small).by_weight == ()


def test_the_batch_growth_of_decode_is_recovered_from_synthetic_sweeps():
    """TPOT(B) = TPOT(1) (1 + r (B-1)) per (weight format, tensor degree), each run's
    TPOT the slope of its latencies over output lengths (its TTFT, however it grows with
    the batch, drops out); runs of one format and degree agree on r through their
    median, and a run with no batch-1 series or one output length tells nothing."""
    from services.estimation.calibrate import BatchPoint, fit_tpot_batch_growth

    truth = {("fp16", 1): 0.006, ("int4", 2): 0.023, ("fp16", 4): 0.04}
    rng = np.random.default_rng(0)
    points = []
    for (weight, tp), r in truth.items():
        for run, tpot1 in enumerate((0.02, 0.011, 0.035)):
            for batch in (1, 8, 16, 32, 64):
                ttft = 0.01 * batch  # prefill grows with the batch: not decode's
                noise = 1 + rng.normal(0, 0.002)
                for output in (50, 100, 200):
                    latency = ttft + output * tpot1 * (1 + r * (batch - 1)) * noise
                    points.append(BatchPoint(weight, tp, (weight, run), batch, output, latency))
    points.append(BatchPoint("int8", 1, "one length", 1, 50, 1.0))
    points.append(BatchPoint("int8", 1, "one length", 8, 50, 1.3))
    points += [BatchPoint("int8", 2, "no batch 1", 8, o, o * 0.01) for o in (50, 100)]
    fitted = {(w, tp): r for w, tp, r in fit_tpot_batch_growth(points)}
    assert set(fitted) == set(truth)
    for key, r in truth.items():
        assert fitted[key] == pytest.approx(r, rel=0.05)
