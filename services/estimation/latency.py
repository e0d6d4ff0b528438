"""Latency of any (tp, pp) from three reference layouts (the papers' Eq. 2 and 3).

    L(tp, pp) = L(1,1) / (tp * pp**alpha)
              + (tp - 1)**beta / pp**gamma * O_TP
              + (pp - 1)**delta * O_PP
    O_TP = L(2,1) - L(1,1) / 2
    O_PP = L(1,2) - L(1,1) / 2**alpha            (iServe, Eq. 3; the default here)
    O_PP = L(1,1) - L(1,1) / 2**alpha            (what MaverIQ's code computed)

``L`` may be any latency-like quantity: the papers apply it to end-to-end latency at one
output length; iserve applies it separately to TTFT and to TPOT with constants of their
own (:class:`PhaseConstants`), because prefill and decode scale very differently with
tensor parallelism on the same hardware (prefill moves prompt-sized activations through
every all-reduce, decode moves one token's), and then composes
``L = TTFT + count * TPOT`` with :func:`decode_steps`' count: ``output_tokens - 1`` for
phases timed from a token stream (the prefill gives the first token), ``output_tokens``
for phases split out of end-to-end latencies the papers' way.

When a model was also profiled at (tp, 1) for a tp above 2 (a "TP ladder"), the measured
overhead ``O_TP(tp) = L(tp,1) - L(1,1)/tp`` replaces the extrapolated
``(tp - 1)**beta * O_TP``: how badly an all-reduce scales over a PCIe box differs from
model to model more than one beta can follow.

Batch (MaverIQ Eq. 6): ``L(B) = L(1) + (B - 1) * O_BS``.

Every function broadcasts over numpy arrays: references of shape (k,) against layouts of
shape (k,) or scalars; nothing loops over configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "BASE",
    "PIPELINE",
    "REFERENCE_BATCHES",
    "REFERENCE_LAYOUTS",
    "TENSOR",
    "O_PP_FROM_BASE",
    "O_PP_FROM_PP2",
    "ParallelConstants",
    "PhaseConstants",
    "ReferenceScales",
    "decode_steps",
    "latency_at_batch",
    "parallel_latency",
    "parallel_overheads",
    "phase_latency",
    "split_references",
]

BASE, TENSOR, PIPELINE = (1, 1), (2, 1), (1, 2)
# The references of Eq. 2, in the order every reference triple of this package uses.
REFERENCE_LAYOUTS: tuple[tuple[int, int], ...] = (BASE, TENSOR, PIPELINE)
# The batch sizes fingerprints are extrapolated at: the references at batch 1, the
# per-sequence overhead of MaverIQ's batch model (Eq. 6) from batch 2; larger batches
# are estimated from those two.
REFERENCE_BATCHES: tuple[int, int] = (1, 2)


def decode_steps(output_tokens, end_to_end_split=False) -> np.ndarray:
    """How many TPOTs follow the TTFT in a request of ``output_tokens`` tokens, by how
    TTFT and TPOT were measured.

    Timed from a token stream (the profiler's jobs, the scheduler's requests): TTFT is
    the first token's arrival, which the prefill produced, and TPOT the mean gap between
    the tokens after it, so ``latency = TTFT + (N - 1) * TPOT``. Split out of end-to-end
    latencies at two or more output lengths (``end_to_end_split``; measurements with no
    token timestamps, such as MaverIQ's): the papers fit ``L = TTFT + N * TPOT``, so N.
    Broadcasts over numpy arrays; 0 for one token from a stream."""
    n = np.asarray(output_tokens, dtype=float)
    return np.where(np.asarray(end_to_end_split, dtype=bool), n, np.maximum(n - 1.0, 0.0))


# Where O_PP comes from: the measured pp = 2 reference (iServe) or the base layout
# (MaverIQ's code, which in effect set L(1,2) = L(1,1)).
O_PP_FROM_PP2 = "pp2"
O_PP_FROM_BASE = "base"


@dataclass(frozen=True)
class ParallelConstants:
    """The exponents of Eq. 2, fitted once per hardware type (dimensionless).

    ``tp_ratio`` holds, per tensor degree above 2, the hardware's measured
    ``O_TP(tp) / O_TP(2)`` (the median over the calibration data at pp = 1); where it has
    a degree, it replaces ``(tp - 1)**beta``. An all-reduce over a PCIe box does not grow
    as a power of the peers: on the A6000 data the per-layer decode overhead at tp = 8 is
    3.7-5 times that at tp = 2 while tp = 4 is 1.8-1.9 times, which no one beta follows.
    """

    alpha: float
    beta: float
    gamma: float
    delta: float
    tp_ratio: tuple[tuple[int, float], ...] = ()

    def as_array(self) -> np.ndarray:
        return np.array([self.alpha, self.beta, self.gamma, self.delta], dtype=float)

    @classmethod
    def from_array(
        cls, values: np.ndarray, tp_ratio: tuple[tuple[int, float], ...] = ()
    ) -> ParallelConstants:
        alpha, beta, gamma, delta = (float(v) for v in values)
        return cls(alpha, beta, gamma, delta, tp_ratio)


@dataclass(frozen=True)
class PhaseConstants:
    """Separate Eq. 2 exponents for time to first token and time per output token."""

    ttft: ParallelConstants
    tpot: ParallelConstants


@dataclass(frozen=True)
class ReferenceScales:
    """Calibrated factors on the extrapolated (1,1), (2,1), (1,2) references, per phase.

    Fingerprints of one or two layers under-extrapolate the full model by a few percent
    on the same hardware (on the A6000 data the median full-model TTFT and TPOT are 2-5 %
    above the extrapolation at (1,1)); the factor is the median of measured / extrapolated
    over the calibration data (dimensionless; 1 means no correction). TP-ladder layouts
    are left alone.

    ``by_weight`` holds factors of their own for weight formats the calibration data
    had, as (format, TTFT factors, TPOT factors): how far a fingerprint's layer runs
    from a full model's depends on the kernel that reads the weights (on this
    project's CPU devices an int8 decode layer of a 24-layer model takes 1.09-1.22 times
    its time in a one- or two-layer fingerprint, whose weights stay in cache, a float
    layer 0.93-1.02 times). A format without an entry takes ``ttft`` / ``tpot``.
    """

    ttft: tuple[float, float, float] = (1.0, 1.0, 1.0)
    tpot: tuple[float, float, float] = (1.0, 1.0, 1.0)
    by_weight: tuple[tuple[str, tuple[float, float, float], tuple[float, float, float]], ...] = ()

    def factors(self, weight: str | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(TTFT, TPOT) factors of the three references for a weight format."""
        for name, ttft, tpot in self.by_weight:
            if name == weight:
                return ttft, tpot
        return self.ttft, self.tpot

    def apply(
        self,
        ttft_refs: np.ndarray,
        tpot_refs: np.ndarray,
        weights: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scaled copies of reference arrays whose last axis starts with the references.

        ``weights`` names each row's weight format (aligned with the arrays' first axis);
        without it every row takes the all-format factors.
        """
        ttft = np.array(ttft_refs, dtype=float)
        tpot = np.array(tpot_refs, dtype=float)
        if weights is None or not self.by_weight:
            ttft[..., :3] *= np.asarray(self.ttft)
            tpot[..., :3] *= np.asarray(self.tpot)
            return ttft, tpot
        pairs = [self.factors(w) for w in np.asarray(weights).tolist()]
        ttft[..., :3] *= np.array([f for f, _ in pairs]).reshape(ttft[..., :3].shape)
        tpot[..., :3] *= np.array([p for _, p in pairs]).reshape(tpot[..., :3].shape)
        return ttft, tpot


def _power(base: np.ndarray, exponent: float) -> np.ndarray:
    # 0 ** exponent is 0 for the layouts without that kind of parallelism, for any
    # exponent >= 0 (numpy gives 1 for 0 ** 0, which would charge tp = 1 an O_TP).
    base = np.asarray(base, dtype=float)
    return np.where(base > 0, np.power(np.maximum(base, 1e-300), exponent), 0.0)


def parallel_overheads(
    l11: np.ndarray,
    l21: np.ndarray,
    l12: np.ndarray,
    constants: ParallelConstants,
    o_pp_from: str = O_PP_FROM_PP2,
) -> tuple[np.ndarray, np.ndarray]:
    """(O_TP, O_PP) of Eq. 3 in the unit of the references (seconds)."""
    l11 = np.asarray(l11, dtype=float)
    o_tp = np.asarray(l21, dtype=float) - l11 / 2.0
    if o_pp_from == O_PP_FROM_PP2:
        o_pp = np.asarray(l12, dtype=float) - l11 / 2.0**constants.alpha
    elif o_pp_from == O_PP_FROM_BASE:
        o_pp = l11 - l11 / 2.0**constants.alpha
    else:
        raise ValueError(f"o_pp_from must be {O_PP_FROM_PP2!r} or {O_PP_FROM_BASE!r}")
    return o_tp, o_pp


def parallel_latency(
    l11: np.ndarray,
    l21: np.ndarray,
    l12: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    constants: ParallelConstants,
    o_pp_from: str = O_PP_FROM_PP2,
    clamp_overheads: bool = False,
    tp_ladder: dict[int, np.ndarray] | None = None,
) -> np.ndarray:
    """Eq. 2: latency at (tp, pp) from the (1,1), (2,1), (1,2) references (seconds).

    ``clamp_overheads`` clips L(1,1), O_TP and O_PP at zero as MaverIQ's code did; a
    negative overhead is physically possible (a second pipeline stage can run a little
    faster than one), so iserve does not clip by default. ``tp_ladder`` maps a tp above
    2 to the measured L(tp, 1), whose overhead then replaces the extrapolated one (NaN
    entries fall back to the extrapolation).
    """
    tp = np.asarray(tp, dtype=float)
    pp = np.asarray(pp, dtype=float)
    l11 = np.asarray(l11, dtype=float)
    o_tp, o_pp = parallel_overheads(l11, l21, l12, constants, o_pp_from)
    if clamp_overheads:
        l11, o_tp, o_pp = np.maximum(l11, 0.0), np.maximum(o_tp, 0.0), np.maximum(o_pp, 0.0)
    c = constants
    tp_overhead = _power(tp - 1.0, c.beta) * o_tp
    for degree, ratio in c.tp_ratio:
        tp_overhead = np.where(tp == degree, ratio * o_tp, tp_overhead)
    # Beyond tp = 2 the overhead is extrapolated: a negative O_TP (L(2,1) a little under
    # half of L(1,1), within the fingerprints' timing noise) multiplied by (tp - 1)**beta
    # would make communication speed a layout up, down to a negative latency.
    tp_overhead = np.where(tp > 2, np.maximum(tp_overhead, 0.0), tp_overhead)
    for degree, measured in (tp_ladder or {}).items():
        measured = np.asarray(measured, dtype=float)
        # NaN: that variant was not profiled at (degree, 1); keep the extrapolation.
        use = (tp == degree) & np.isfinite(measured)
        tp_overhead = np.where(use, np.nan_to_num(measured) - l11 / degree, tp_overhead)
    return (
        l11 / (tp * np.power(pp, c.alpha))
        + tp_overhead / np.power(pp, c.gamma)
        + _power(pp - 1.0, c.delta) * o_pp
    )


def split_references(
    refs: np.ndarray, layouts: tuple[tuple[int, int], ...] = REFERENCE_LAYOUTS
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """(L(1,1), L(2,1), L(1,2), TP ladder) from an array whose last axis follows ``layouts``."""
    refs = np.asarray(refs, dtype=float)
    if tuple(layouts[:3]) != REFERENCE_LAYOUTS:
        raise ValueError(f"layouts must start with {REFERENCE_LAYOUTS}, got {layouts}")
    ladder = {}
    for i, (tp, pp) in enumerate(layouts[3:], start=3):
        if pp != 1 or tp <= 2:
            raise ValueError(f"extra reference layouts must be (tp, 1) with tp > 2, got {(tp, pp)}")
        ladder[tp] = refs[..., i]
    return refs[..., 0], refs[..., 1], refs[..., 2], ladder


def phase_latency(
    ttft_refs: np.ndarray,
    tpot_refs: np.ndarray,
    tp: np.ndarray,
    pp: np.ndarray,
    tpot_counts: np.ndarray,
    constants: PhaseConstants,
    o_pp_from: str = O_PP_FROM_PP2,
    layouts: tuple[tuple[int, int], ...] = REFERENCE_LAYOUTS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(TTFT, TPOT, end-to-end latency) at (tp, pp), seconds; the latency is TTFT plus
    ``tpot_counts`` TPOTs (:func:`decode_steps` of the output length).

    The last axis of ``ttft_refs`` and ``tpot_refs`` follows ``layouts``: the (1,1),
    (2,1), (1,2) references, then any TP-ladder layouts (tp, 1).
    """
    *f_refs, f_ladder = split_references(ttft_refs, layouts)
    *p_refs, p_ladder = split_references(tpot_refs, layouts)
    ttft = parallel_latency(*f_refs, tp, pp, constants.ttft, o_pp_from, tp_ladder=f_ladder)
    tpot = parallel_latency(*p_refs, tp, pp, constants.tpot, o_pp_from, tp_ladder=p_ladder)
    return ttft, tpot, ttft + np.asarray(tpot_counts, dtype=float) * tpot


def latency_at_batch(
    latency_1: np.ndarray, overhead_per_sequence: np.ndarray, batch: np.ndarray
) -> np.ndarray:
    """MaverIQ Eq. 6: ``L(B) = L(1) + (B - 1) * O_BS`` (seconds)."""
    batch = np.asarray(batch, dtype=float)
    if np.any(batch < 1):
        raise ValueError("batch sizes must be at least 1")
    return np.asarray(latency_1, dtype=float) + (batch - 1.0) * np.asarray(overhead_per_sequence)
