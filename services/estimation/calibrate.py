"""Calibration: fit the hardware constants on measured full-model data points.

The papers fit Eq. 2's exponents by gradient descent on the mean absolute percentage
error (MAPE) over a few hundred measured deployments, once per hardware type. This
module does the same in numpy: projected gradient descent with Adam steps on
central-difference gradients, from a fixed set of starting points (the loss is not
convex), keeping the best iterate. Same inputs, same result: nothing is random.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from services.estimation.latency import (
    BASE,
    O_PP_FROM_PP2,
    REFERENCE_LAYOUTS,
    ParallelConstants,
    PhaseConstants,
    ReferenceScales,
    parallel_latency,
    phase_latency,
    split_references,
)
from services.estimation.memory import MemoryConstants, solve_memory_components, total_memory_gib

__all__ = [
    "EXPONENT_BOUNDS",
    "FitResult",
    "calibrate_latency",
    "fit_reference_scales",
    "calibrate_memory_constants",
    "calibrate_parallel_constants",
    "calibrate_phase_constants",
    "BatchPoint",
    "fit_tp_ratios",
    "fit_tpot_batch_growth",
    "mape_pct",
    "minimize_mape",
]

# Bounds of alpha, beta, gamma, delta: none may be negative (the terms would change
# sign), and beyond these values the model only chases noise.
EXPONENT_BOUNDS = (np.array([0.0, 0.0, 0.0, 0.0]), np.array([1.5, 4.0, 3.0, 3.0]))
_EXPONENT_STARTS = (
    np.array([0.05, 0.75, 0.5, 1.2]),  # MaverIQ's initial values
    np.array([0.05, 1.5, 0.5, 0.5]),
    np.array([0.2, 0.5, 1.0, 1.0]),
)


@dataclass(frozen=True)
class FitResult:
    """Fitted parameters and the MAPE (%) they reach on the fitting data."""

    params: tuple[float, ...]
    mape_pct: float
    iterations: int


def mape_pct(estimate: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error, %."""
    measured = np.asarray(measured, dtype=float)
    return float(100.0 * np.mean(np.abs((np.asarray(estimate) - measured) / measured)))


def minimize_mape(
    predict: Callable[[np.ndarray], np.ndarray],
    measured: np.ndarray,
    starts: Sequence[np.ndarray],
    lower: np.ndarray,
    upper: np.ndarray,
    steps: int = 400,
    learning_rate: float = 0.05,
) -> FitResult:
    """Projected Adam descent on MAPE from each start; returns the best point seen.

    ``predict`` maps a parameter vector to estimates shaped like ``measured``. The step
    size decays from ``learning_rate`` (in parameter units) to a hundredth of it.
    """
    measured = np.asarray(measured, dtype=float)
    if measured.size == 0:
        raise ValueError("no measurements to fit")
    if np.any(measured <= 0):
        raise ValueError("measurements must be positive to compute a percentage error")
    lower = np.asarray(lower, dtype=float)
    upper = np.asarray(upper, dtype=float)

    def loss(params: np.ndarray) -> float:
        value = mape_pct(predict(params), measured)
        return value if np.isfinite(value) else np.inf

    best_params, best_loss, total = None, np.inf, 0
    for start in starts:
        params = np.clip(np.asarray(start, dtype=float), lower, upper)
        first, second = np.zeros_like(params), np.zeros_like(params)
        eps = 1e-4 * np.maximum(1.0, np.abs(upper - lower))
        current = loss(params)
        for step in range(1, steps + 1):
            grad = np.empty_like(params)
            for i in range(params.size):
                bump = np.zeros_like(params)
                bump[i] = eps[i]
                grad[i] = (
                    loss(np.clip(params + bump, lower, upper))
                    - loss(np.clip(params - bump, lower, upper))
                ) / (2 * eps[i])
            grad = np.where(np.isfinite(grad), grad, 0.0)
            first = 0.9 * first + 0.1 * grad
            second = 0.999 * second + 0.001 * grad**2
            rate = learning_rate * 0.01 ** (step / steps)
            m_hat = first / (1 - 0.9**step)
            v_hat = second / (1 - 0.999**step)
            params = np.clip(params - rate * m_hat / (np.sqrt(v_hat) + 1e-12), lower, upper)
            current = loss(params)
            if current < best_loss:
                best_loss, best_params = current, params.copy()
        total += steps
    if best_params is None:
        raise ValueError("calibration never reached a finite error; check the inputs")
    return FitResult(tuple(float(p) for p in best_params), float(best_loss), total)


def calibrate_parallel_constants(
    refs: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    measured: np.ndarray,
    o_pp_from: str = O_PP_FROM_PP2,
    clamp_overheads: bool = False,
    steps: int = 400,
    layouts: tuple[tuple[int, int], ...] = REFERENCE_LAYOUTS,
    tp_ratio: tuple[tuple[int, float], ...] = (),
) -> tuple[ParallelConstants, FitResult]:
    """Fit alpha, beta, gamma, delta of Eq. 2 on one latency-like quantity (with the
    hardware's ``tp_ratio`` table fixed, when given).

    ``refs`` is (k, len(layouts)): each data point's references in seconds, in the order
    of ``layouts``; ``measured`` the measured value at (tp, pp).
    """
    l11, l21, l12, ladder = split_references(refs, layouts)

    def predict(params: np.ndarray) -> np.ndarray:
        constants = ParallelConstants.from_array(params, tp_ratio)
        return parallel_latency(
            l11, l21, l12, tp, pp, constants, o_pp_from, clamp_overheads, tp_ladder=ladder
        )

    fit = minimize_mape(predict, measured, _EXPONENT_STARTS, *EXPONENT_BOUNDS, steps=steps)
    return ParallelConstants.from_array(np.array(fit.params), tp_ratio), fit


def fit_tp_ratios(
    refs: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    measured: np.ndarray,
    layouts: tuple[tuple[int, int], ...] = REFERENCE_LAYOUTS,
) -> tuple[tuple[int, float], ...]:
    """Per tensor degree above 2 measured at pp = 1: the median over those data points of
    ``(measured - L(1,1)/tp) / O_TP(2)``, points with a positive ``O_TP(2)`` only.

    The hardware's own TP ladder, measured on the calibration models in full: it replaces
    Eq. 2's ``(tp - 1)**beta`` at those degrees (see :class:`ParallelConstants`).
    """
    l11, l21, _, _ = split_references(refs, layouts)
    tp = np.asarray(tp, dtype=float)
    pp = np.asarray(pp, dtype=float)
    o_tp2 = l21 - l11 / 2.0
    ratios = []
    for degree in sorted({int(t) for t in tp[(tp > 2) & (pp == 1)]}):
        at = (tp == degree) & (pp == 1) & (o_tp2 > 0) & np.isfinite(o_tp2)
        if at.any():
            ratio = (np.asarray(measured, dtype=float)[at] - l11[at] / degree) / o_tp2[at]
            ratios.append((degree, float(np.median(ratio))))
    return tuple(ratios)


@dataclass(frozen=True)
class BatchPoint:
    """One full-model run at some batch size: its weight format and tensor degree, the
    run it belongs to (``run``: model, variant and layout, any hashable), batch size,
    output length and end-to-end latency (seconds)."""

    weight: str
    tp: int
    run: object
    batch: int
    output_tokens: int
    latency_s: float


def fit_tpot_batch_growth(points: Sequence[BatchPoint]) -> tuple[tuple[str, int, float], ...]:
    """The hardware's decode growth per further sequence of a batch, as a share of the
    batch-1 TPOT, per (weight format, tensor degree): ``TPOT(B) = TPOT(1) * (1 + r (B-1))``.

    Each run's TPOT at each batch size is the slope of its latency over output lengths
    (two or more); a run measured at batch 1 and above gives ``r`` by least squares
    through the origin of ``TPOT(B)/TPOT(1) - 1`` on ``B - 1``, and a (weight, tp) takes
    the median of its runs' (none below 0). What a batch-2 profile cannot show: on the
    A6000 a second sequence's decode costs what the first's does within the timing
    noise, while 64 take 1.4x (float16) to 2.5x (int4) the time of one on the same
    layout, linearly up to 512 sequences (MaverIQ's batch sweeps).
    """
    tpots: dict[tuple, list[tuple[int, float]]] = {}
    for p in points:
        tpots.setdefault((p.weight, p.tp, p.run, p.batch), []).append(
            (p.output_tokens, p.latency_s)
        )
    slopes: dict[tuple, dict[int, float]] = {}
    for (weight, tp, run, batch), series in tpots.items():
        outputs = np.array([o for o, _ in series], dtype=float)
        if len(set(outputs)) < 2:
            continue
        latency = np.array([t for _, t in series], dtype=float)
        slope = float(np.polyfit(outputs, latency, 1)[0])
        if slope > 0 and np.isfinite(slope):
            slopes.setdefault((weight, tp, run), {})[batch] = slope
    by_format: dict[tuple[str, int], list[float]] = {}
    for (weight, tp, _run), at in slopes.items():
        if 1 not in at or len(at) < 2:
            continue
        x = np.array([b - 1.0 for b in at if b > 1])
        y = np.array([at[b] / at[1] - 1.0 for b in at if b > 1])
        by_format.setdefault((weight, tp), []).append(float(x @ y / (x @ x)))
    return tuple(
        (weight, tp, max(0.0, float(np.median(rates))))
        for (weight, tp), rates in sorted(by_format.items())
    )


def calibrate_phase_constants(
    ttft_refs: np.ndarray,
    tpot_refs: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    tpot_counts: np.ndarray,
    measured_latency: np.ndarray,
    initial: PhaseConstants,
    o_pp_from: str = O_PP_FROM_PP2,
    steps: int = 400,
    layouts: tuple[tuple[int, int], ...] = REFERENCE_LAYOUTS,
) -> tuple[PhaseConstants, FitResult]:
    """Fit TTFT and TPOT exponents together on end-to-end latency MAPE.

    ``initial`` is usually the result of fitting each phase on its own measurements
    (:func:`calibrate_parallel_constants`); the joint fit then trades the two off where
    the end-to-end error, the figure users see, prefers it.
    """

    def constants_of(params: np.ndarray) -> PhaseConstants:
        return PhaseConstants(
            ParallelConstants.from_array(params[:4], initial.ttft.tp_ratio),
            ParallelConstants.from_array(params[4:], initial.tpot.tp_ratio),
        )

    def predict(params: np.ndarray) -> np.ndarray:
        constants = constants_of(params)
        return phase_latency(
            ttft_refs, tpot_refs, tp, pp, tpot_counts, constants, o_pp_from, layouts
        )[2]

    start = np.concatenate([initial.ttft.as_array(), initial.tpot.as_array()])
    lower = np.concatenate([EXPONENT_BOUNDS[0]] * 2)
    upper = np.concatenate([EXPONENT_BOUNDS[1]] * 2)
    fit = minimize_mape(
        predict, measured_latency, [start], lower, upper, steps=steps, learning_rate=0.02
    )
    return constants_of(np.array(fit.params)), fit


def calibrate_memory_constants(
    refs: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    measured_gib: np.ndarray,
    steps: int = 300,
    layout_residuals: bool = True,
) -> tuple[MemoryConstants, FitResult]:
    """Fit the per-peer device overhead on memory MAPE, then the per-layout residuals.

    The per-peer term is fitted only when some data point has tp > 2 (0 otherwise).

    ``refs`` is (k, 3): each data point's extrapolated (1,1), (2,1), (1,2) footprints
    in GiB; ``measured_gib`` the measured footprint at (tp, pp). The residual of a
    layout is the median of (measured - model) over its data points, in GiB; the
    reference layouts get none (the model reproduces them by construction). The
    returned fit error is that of the final constants.
    """
    refs = np.asarray(refs, dtype=float)[:, :3]
    tp = np.asarray(tp, dtype=float)
    pp = np.asarray(pp, dtype=float)
    measured_gib = np.asarray(measured_gib, dtype=float)

    def predict_with(constants: MemoryConstants) -> np.ndarray:
        parts = solve_memory_components(refs[:, 0], refs[:, 1], refs[:, 2], constants)
        return total_memory_gib(parts, tp, pp, constants)

    if np.any(tp > 2):
        fit = minimize_mape(
            lambda params: predict_with(MemoryConstants(tp_peer_gib=float(params[0]))),
            measured_gib,
            [np.array([0.0]), np.array([0.5])],
            np.array([0.0]),
            np.array([4.0]),
            steps=steps,
        )
    else:
        # Only tp <= 2 measured: the references reproduce tp = 1 and 2 whatever the
        # per-peer term is, so the data cannot identify it (a descent would leave it
        # wherever it wandered, and tp = 8 would inherit that): keep it at 0.
        fit = FitResult((0.0,), mape_pct(predict_with(MemoryConstants()), measured_gib), 0)
    constants = MemoryConstants(tp_peer_gib=fit.params[0])
    if layout_residuals:
        base = predict_with(constants)
        residuals = []
        for layout in sorted(
            set(zip(tp.astype(int).tolist(), pp.astype(int).tolist(), strict=True))
        ):
            if layout in REFERENCE_LAYOUTS:
                continue
            at = (tp == layout[0]) & (pp == layout[1])
            residuals.append((layout, float(np.median(measured_gib[at] - base[at]))))
        constants = MemoryConstants(constants.tp_peer_gib, tuple(residuals))
    final = mape_pct(predict_with(constants), measured_gib)
    return constants, FitResult(fit.params, final, fit.iterations)


def fit_reference_scales(
    ttft_refs: np.ndarray,
    tpot_refs: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    measured_ttft: np.ndarray,
    measured_tpot: np.ndarray,
    weights: np.ndarray | None = None,
    models: np.ndarray | None = None,
) -> ReferenceScales:
    """Median measured / extrapolated TTFT and TPOT at each reference layout.

    Rows are data points as in :func:`calibrate_latency`; a reference layout without
    data points keeps the factor 1. With ``weights`` and ``models`` (each row's weight
    format and model), a weight format whose rows depart from their model's median the
    same way on every calibration model gets factors of its own (:func:`_weight_factors`).
    """
    tp, pp = np.asarray(tp), np.asarray(pp)
    # Per phase, measured / extrapolated of every row at each reference layout's column.
    ratios = {
        phase: np.asarray(measured, dtype=float)[:, None] / np.asarray(refs, dtype=float)[:, :3]
        for phase, refs, measured in (
            ("ttft", ttft_refs, measured_ttft),
            ("tpot", tpot_refs, measured_tpot),
        )
    }
    every = {}
    for phase, ratio in ratios.items():
        factors = []
        for i, (layout_tp, layout_pp) in enumerate(REFERENCE_LAYOUTS):
            at = ratio[(tp == layout_tp) & (pp == layout_pp), i]
            at = at[np.isfinite(at) & (at > 0)]
            factors.append(float(np.exp(np.median(np.log(at)))) if at.size else 1.0)
        every[phase] = tuple(factors)
    by_weight = ()
    if weights is not None and models is not None:
        base = (tp == BASE[0]) & (pp == BASE[1])
        by_weight = _weight_factors(
            {phase: ratio[:, 0] for phase, ratio in ratios.items()},
            base,
            np.asarray(weights),
            np.asarray(models),
            every,
        )
    return ReferenceScales(ttft=every["ttft"], tpot=every["tpot"], by_weight=by_weight)


def _weight_factors(
    base_ratios: dict[str, np.ndarray],
    at: np.ndarray,
    weights: np.ndarray,
    models: np.ndarray,
    every: dict[str, tuple[float, ...]],
) -> tuple[tuple[str, tuple[float, ...], tuple[float, ...]], ...]:
    """Per weight format and phase, the all-format factors times the median over the
    calibration models of (the format's measured / extrapolated at (1,1)) / (every
    format's), kept only where that ratio lies on the same side of 1 for every model
    (two at least) that has the format, and departs from 1 by more than the models'
    own factors spread (median absolute deviation of their logs): a kernel's own
    departure, larger than what a factor fitted on other models can promise anyway.

    On this project's CPU devices int8 decode sits 8-10 % above its model's median and
    float 8-10 % below on all three calibration models (an int8 fingerprint's weights
    stay in cache, a full model's do not); the per-format factors took the CPU bench's
    leave-one-architecture-out latency from 7.6 % to 3.7 % median. On the A6000 data the
    formats' departures are a few percent with signs that vary between models, and
    factors of their own for every format made held-out latency worse (LOAO 2.2 / 6.5 %
    -> 2.5 / 7.2 %), which the same-sign rule leaves out.

    ``base_ratios``: per phase, each row's measured / extrapolated at (1,1); ``at``: the
    rows measured at (1,1).
    """
    # Each calibration model's factor per phase, and how far the models' factors spread.
    model_factor = {
        phase: {m: float(np.median(ratio[at & (models == m)])) for m in set(models[at].tolist())}
        for phase, ratio in base_ratios.items()
    }
    spread = {}
    for phase, factors in model_factor.items():
        logs = np.log(list(factors.values()))
        spread[phase] = float(np.median(np.abs(logs - np.median(logs))))
    out = []
    for weight in sorted(set(weights[at].tolist())):
        chosen = {}
        for phase, ratio in base_ratios.items():
            relative = np.array(
                [
                    np.median(ratio[at & (models == model) & (weights == weight)])
                    / model_factor[phase][model]
                    for model in sorted(set(models[at & (weights == weight)].tolist()))
                ]
            )
            same_side = np.all(relative > 1.0) or np.all(relative < 1.0)
            above_spread = abs(np.log(np.median(relative))) > spread[phase]
            if relative.size >= 2 and same_side and above_spread:
                chosen[phase] = tuple(x * float(np.median(relative)) for x in every[phase])
        if chosen:
            out.append(
                (str(weight), chosen.get("ttft", every["ttft"]), chosen.get("tpot", every["tpot"]))
            )
    return tuple(out)


def calibrate_latency(
    ttft_refs: np.ndarray,
    tpot_refs: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    tpot_counts: np.ndarray,
    measured_latency: np.ndarray,
    measured_ttft: np.ndarray,
    measured_tpot: np.ndarray,
    o_pp_from: str = O_PP_FROM_PP2,
    layouts: tuple[tuple[int, int], ...] = REFERENCE_LAYOUTS,
    steps: int = 250,
    scale_references: bool = True,
    tp_ratios: bool = True,
    weights: np.ndarray | None = None,
    models: np.ndarray | None = None,
) -> tuple[PhaseConstants, ReferenceScales, FitResult]:
    """Fit the latency side of a calibration on measured full-model data points.

    One row per data point: its variant's extrapolated references (``layouts`` order),
    its layout, the TPOTs after its TTFT (``tpot_counts``: :func:`decode_steps` of its output
    length, by how its references' phases were measured), the measured end-to-end
    latency, TTFT and TPOT
    (seconds; the TTFT and TPOT of a full-model layout come from a least-squares line
    through its latencies at several output lengths). First the reference scales (when
    ``scale_references``), then each phase's exponents on its own measurements, then
    both phases jointly on end-to-end MAPE. Returns the constants, the scales and the
    end-to-end fit. ``weights`` and ``models`` (each row's weight format and model) let
    a weight format have reference scales of its own (:func:`fit_reference_scales`).
    """
    scales = (
        fit_reference_scales(
            ttft_refs, tpot_refs, tp, pp, measured_ttft, measured_tpot, weights, models
        )
        if scale_references
        else ReferenceScales()
    )
    ttft_refs, tpot_refs = scales.apply(ttft_refs, tpot_refs, weights)
    ratios = {
        phase: fit_tp_ratios(refs, tp, pp, measured, layouts) if tp_ratios else ()
        for phase, refs, measured in (
            ("ttft", ttft_refs, measured_ttft),
            ("tpot", tpot_refs, measured_tpot),
        )
    }
    ttft_constants, _ = calibrate_parallel_constants(
        ttft_refs,
        tp,
        pp,
        measured_ttft,
        o_pp_from,
        steps=steps,
        layouts=layouts,
        tp_ratio=ratios["ttft"],
    )
    tpot_constants, _ = calibrate_parallel_constants(
        tpot_refs,
        tp,
        pp,
        measured_tpot,
        o_pp_from,
        steps=steps,
        layouts=layouts,
        tp_ratio=ratios["tpot"],
    )
    constants, fit = calibrate_phase_constants(
        ttft_refs,
        tpot_refs,
        tp,
        pp,
        tpot_counts,
        measured_latency,
        PhaseConstants(ttft_constants, tpot_constants),
        o_pp_from,
        steps=steps,
        layouts=layouts,
    )
    return constants, scales, fit
