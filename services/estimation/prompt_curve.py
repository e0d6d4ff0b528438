"""A model's reference figures at any prompt length, from those profiled at a few.

Prefill's time is the prompt's weight products, linear in its length, plus its
attention, quadratic; decode's grows with the KV cache it reads; a prefill's
activations grow linearly. :func:`profiles_at` follows those curves through the
profiled lengths (iserve's profiler times three: 64, 256
and 1024 tokens by default). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from services.estimation.references import ReferenceProfile, VariantProfile

__all__ = ["grown_ttft", "one_length", "prefill_along", "profiles_at", "recorded"]


def recorded(lengths: Sequence[int]) -> Sequence[int]:
    """``lengths`` (ascending) when every one was recorded, else none: a single 0 stands
    for a prompt length not recorded, which no curve goes through."""
    return lengths if lengths[0] > 0 else []


def one_length(lengths: Sequence[int]) -> bool:
    """Whether ``lengths`` record one prompt length (beside a 0, not recorded, or alone):
    an import of one prompt's measurements."""
    return sum(1 for n in lengths if n > 0) == 1


def profiles_at(
    lengths: Sequence[int],
    profiles: Sequence[Sequence[VariantProfile]],
    input_tokens: int,
    attention_share: float | None = None,
) -> tuple[VariantProfile, ...]:
    """Every variant's profile for an ``input_tokens`` prompt, from ``profiles`` (one
    tuple of variant profiles per profiled prompt length, ``lengths`` ascending; a
    single length 0 stands for one not recorded).

    With three or more recorded lengths TTFT and TPOT follow the parabola through the
    three profiled lengths nearest ``input_tokens`` (memory the line through the two
    nearest, as with two lengths): between two of them they stay within their two
    figures; beyond the longest TTFT is no lower than the line through the two longest
    (a parabola bending down is noise), and TPOT follows that line (a decode step reads
    the whole context, linear in it). With two, every figure follows their line. Beyond
    the longest, no figure falls below the longest's own: a longer prompt is no faster. Below the shortest, and with a single length, the nearest profiled
    length is used as it is.

    With ``attention_share`` (:func:`attention_share`, from the architecture), TTFT
    beyond the longest follows prefill's own shape instead, ``a + b (n + k n^2)``
    through the two longest: the three shortest prompts' curvature is mostly noise, and
    their parabola overshot a 16k-token prompt's TTFT by 58 % (a probe, hidden 256).
    With a single recorded length ``n0`` it follows ``a + b (n + k n^2)`` through it and
    a one-token prompt, whose prefill is a decode step (the layout's TPOT), TPOT and
    memory staying the profiled prompt's; a planner read a 3,900-token prompt's TTFT as
    a 923-token one's (a tester), and a 100-token one's too. Below ``n0`` the same line
    (``bench/prompt_lengths.py``, one 1,024-token profile on a CPU: -22 … +23 % of the
    measured TTFT at 64 to 512 tokens, where the profiled figure was 2 to 10 times it).
    """
    if one_length(lengths) and attention_share is not None and 0 < input_tokens != lengths[-1]:
        # One profiled length (an import of one prompt's measurements): TTFT along the
        # line through it and a one-token prompt's, in prefill's work, either way.
        along = prefill_along(lengths[-1], input_tokens, attention_share)
        return tuple(_ttft_grown(p, along) for p in profiles[-1])
    if input_tokens <= lengths[0]:
        return profiles[0]
    known = len(recorded(lengths))
    if input_tokens >= lengths[-1] and known < 2:
        return profiles[-1]
    beyond = input_tokens > lengths[-1]
    upper = next((i for i, n in enumerate(lengths) if n >= input_tokens), len(lengths) - 1)
    low, high = max(upper - 1, 0), upper
    line = _line_weights(lengths[low], lengths[high], input_tokens)
    pairs = list(zip(profiles[low], profiles[high], strict=True))
    if known < 3:
        if not beyond:
            return tuple(_combine((a, b), line) for a, b in pairs)
        out = [_combine((a, b), line, at_least=(b,)) for a, b in pairs]
    else:
        first = min(max(upper - 1, 0), len(lengths) - 3)
        curve = _parabola_weights(lengths[first : first + 3], input_tokens)
        out = []
        for i, (a, b) in enumerate(pairs):
            points = [p[i] for p in profiles[first : first + 3]]
            if beyond:
                straight = _combine((a, b), line, at_least=(b,))
                timed = _combine(points, curve, at_least=(b, straight))
                # A decode step reads the whole context: linear in it, as memory is.
                out.append(_figures_from(timed, straight, "tpot_s", "memory_gib"))
            else:
                straight = _combine((a, b), line)
                timed = _combine(points, curve, between=(a, b))
                out.append(_figures_from(timed, straight, "memory_gib"))
    if beyond and attention_share is not None:
        shaped = [n + attention_share * n * n for n in (lengths[-2], lengths[-1], input_tokens)]
        prefill = _line_weights(*shaped)
        out = [
            _figures_from(o, _combine((a, b), prefill, at_least=(b,)), "ttft_s")
            for o, (a, b) in zip(out, pairs, strict=True)
        ]
    return tuple(out)


def attention_share(hidden: int, layer_weights: int) -> float:
    """``k`` of prefill's work per layer, ``P n + H n^2`` up to one factor, over ``P``:
    ``n`` tokens through the layer's ``P`` weights (2 FLOPs each), and causal
    attention's ``n^2 / 2`` pairs of query and key at ``4 H`` FLOPs each (scores, then
    values), ``H`` the attention's width."""
    return hidden / layer_weights


def gated_layer_weights(hidden: int, kv_width: int, mlp_width: int) -> int:
    """A decoder layer's weights when only its widths are known: the query and output
    projections (``H x H``), the key and value ones (``H x kv_width``) and a gated MLP's
    three ``H x mlp_width`` matrices (a plain MLP has two)."""
    return 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * mlp_width


def _figures_from(profile: VariantProfile, other: VariantProfile, *names: str) -> VariantProfile:
    """``profile`` with ``other``'s figures ``names`` ("ttft_s", "tpot_s", "memory_gib"),
    at batch 1 and 2."""

    def swapped(mine: ReferenceProfile | None, theirs: ReferenceProfile | None):
        if mine is None:
            return None
        return replace(mine, **{name: getattr(theirs, name) for name in names})

    return replace(
        profile,
        batch1=swapped(profile.batch1, other.batch1),
        batch2=swapped(profile.batch2, other.batch2),
    )


def prefill_along(length: int, input_tokens: int, attention_share: float) -> float:
    """Where an ``input_tokens`` prompt lies on the line from a one-token prompt's
    prefill (a decode step, at 0) to a ``length``-token one's (at 1), in prefill's work
    ``n + k n^2`` (``k``: :func:`attention_share`)."""

    def work(n: int) -> float:
        return n + attention_share * n * n

    return (work(input_tokens) - work(1)) / (work(length) - work(1))


def grown_ttft(ttft: np.ndarray, tpot: np.ndarray, along: float) -> np.ndarray:
    """A TTFT moved ``along`` (:func:`prefill_along`) from its layout's TPOT (a
    one-token prompt's prefill): ``t + (along - 1)(t - p)``; one no higher than its
    TPOT stays."""
    return ttft + (along - 1.0) * np.maximum(ttft - np.nan_to_num(tpot), 0.0)


def _ttft_grown(profile: VariantProfile, along: float) -> VariantProfile:
    """``profile`` with every TTFT (batch 1 and 2) moved ``along`` times its rise from
    the same layout's TPOT (a one-token prompt's prefill) to it: ``t + (along - 1)(t -
    p)`` (``along`` below 1: a shorter prompt's); a TTFT no higher than its TPOT
    stays. A layout without a TPOT of its own (the TP ladder's) takes (1,1)'s over its
    tensor degree."""

    def grown(references: ReferenceProfile | None) -> ReferenceProfile | None:
        if references is None:
            return None
        ttft = np.asarray(references.ttft_s, dtype=float)
        tpot = np.asarray(references.tpot_s, dtype=float)
        # A TP-ladder layout has no TPOT of its own (Eq. 2's): (1,1)'s split tp ways, the
        # least its decode step can take.
        split = [tpot[0] / tp for tp, _ in references.layouts]
        grown = grown_ttft(ttft, np.where(np.isfinite(tpot), tpot, split), along)
        return replace(references, ttft_s=tuple(grown.tolist()))

    return replace(profile, batch1=grown(profile.batch1), batch2=grown(profile.batch2))


def _line_weights(low: int, high: int, x: int) -> tuple[float, float]:
    """Weights of the figures at ``low`` and ``high`` for the line through them at ``x``."""
    t = (x - low) / (high - low)
    return (1.0 - t, t)


def _parabola_weights(points: Sequence[int], x: int) -> tuple[float, ...]:
    """Lagrange weights of the figures at three ``points`` for the parabola through them
    at ``x``."""
    weights = []
    for i, p in enumerate(points):
        w = 1.0
        for j, q in enumerate(points):
            if j != i:
                w *= (x - q) / (p - q)
        weights.append(w)
    return tuple(weights)


def _combine(
    variants: Sequence[VariantProfile],
    weights: Sequence[float],
    at_least: Sequence[VariantProfile] = (),
    between: Sequence[VariantProfile] = (),
) -> VariantProfile:
    """Every figure of ``variants`` (batch 1 and 2 references, and the KV tokens held)
    summed with ``weights``, then raised to the largest of the ``at_least`` profiles'
    and kept within the smallest and largest of the ``between`` ones' (each when
    given). NaN (a TP-ladder figure left to Eq. 2) stays NaN."""

    def figure(values: Sequence, low: Sequence, bounds: Sequence) -> np.ndarray:
        out = sum(w * np.asarray(v, dtype=float) for w, v in zip(weights, values, strict=True))
        if low:  # np.maximum and np.minimum keep NaN
            out = np.maximum(out, np.max(np.asarray(low, dtype=float), axis=0))
        if bounds:
            bounds = np.asarray(bounds, dtype=float)
            out = np.minimum(np.maximum(out, bounds.min(axis=0)), bounds.max(axis=0))
        return out

    def reference(pick) -> ReferenceProfile:
        groups = [[pick(v) for v in group] for group in (variants, at_least, between)]
        fields = {
            name: tuple(float(x) for x in figure(*([getattr(p, name) for p in g] for g in groups)))
            for name in ("ttft_s", "tpot_s", "memory_gib")
        }
        return ReferenceProfile(groups[0][0].layouts, **fields)

    batch2 = None
    if all(v.batch2 is not None for v in (*variants, *at_least, *between)):
        batch2 = reference(lambda v: v.batch2)
    tokens = figure(
        *([v.kv_tokens_profiled for v in group] for group in (variants, at_least, between))
    )
    return replace(
        variants[0],
        batch1=reference(lambda v: v.batch1),
        batch2=batch2,
        kv_tokens_profiled=round(float(tokens)),
    )
