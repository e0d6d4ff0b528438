"""Layer extrapolation: from fingerprints (a few hidden layers) to the full model.

A fingerprint keeps the embeddings, the LM head and ``n`` hidden layers, so everything it
costs splits into a per-layer part and an "other" part (the papers' Eq. 4 and 5):

    TTFT(n) = n * TTFT_layer + TTFT_other
    TPOT(n) = n * TPOT_layer + TPOT_other
    Lat(n, o) = TTFT(n) + o * TPOT(n)          (end to end, o output tokens)
    Mem(n) = n * Mem_layer + Mem_other

The four latency unknowns are solved by least squares over every sample given: direct
TTFT or TPOT measurements (from token timestamps) and end-to-end latencies at several
output lengths (what the MaverIQ data holds) can be mixed freely. Samples taken with
different prompts share the TPOT terms but get TTFT terms of their own (``prompt``
label), so a profile taken with a short prompt still sharpens the TPOT of one taken with
the deployment's prompt; with layer clocks (iserve's own profiler) each label keeps its
own TPOT terms too (see :class:`PooledLatencyFit`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "LAYER_PHASES",
    "PHASES",
    "LatencySample",
    "LayerLatency",
    "LayerLatencyFit",
    "LayerMemory",
    "fit_layer_latency",
    "fit_layer_memory",
    "fit_layer_memory_shared",
]

PHASES = ("end_to_end", "ttft", "tpot", "ttft_layer", "tpot_layer")
# Phases that time one decoder layer inside a run (the worker's layer clock) rather
# than the whole model.
LAYER_PHASES = ("ttft_layer", "tpot_layer")


@dataclass(frozen=True)
class LatencySample:
    """One timing of a model cut to ``layers`` hidden layers.

    ``phase`` says what ``seconds`` is: ``end_to_end`` (a request producing
    ``output_tokens`` tokens), ``ttft`` or ``tpot`` (seconds per output token), or
    ``ttft_layer`` / ``tpot_layer``: the time of one decoder layer in the prefill / a
    decode step, measured inside the run (on a tensor-parallel layout, with its share
    of the all-reduces). ``batch``: the sequences each step carried (the pooled fit
    shares TPOT terms only between samples of one batch size, and with layer clocks
    only within one prompt label).
    """

    layers: int
    seconds: float
    output_tokens: int = 0
    phase: str = "end_to_end"
    prompt: Hashable = "default"
    batch: int = 1

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1, got {self.batch}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.layers < 1:
            raise ValueError(f"layers must be at least 1, got {self.layers}")
        if self.phase == "end_to_end" and self.output_tokens < 1:
            raise ValueError("an end-to-end sample needs output_tokens >= 1")


@dataclass(frozen=True)
class LayerLatency:
    """Per-layer and other latency of one configuration (seconds; TPOT per token)."""

    ttft_per_layer_s: float
    ttft_other_s: float
    tpot_per_layer_s: float
    tpot_other_s: float

    def ttft(self, layers: float) -> float:
        """Time to first token with ``layers`` hidden layers, seconds."""
        return layers * self.ttft_per_layer_s + self.ttft_other_s

    def tpot(self, layers: float) -> float:
        """Time per output token with ``layers`` hidden layers, seconds."""
        return layers * self.tpot_per_layer_s + self.tpot_other_s

    def latency(self, layers: float, output_tokens: float) -> float:
        """End-to-end latency of a request producing ``output_tokens`` tokens, seconds."""
        return self.ttft(layers) + output_tokens * self.tpot(layers)


@dataclass(frozen=True)
class LayerLatencyFit:
    """Result of :func:`fit_layer_latency`: shared TPOT terms, TTFT terms per prompt."""

    tpot_per_layer_s: float
    tpot_other_s: float
    ttft_terms: Mapping[Hashable, tuple[float, float]]
    residual_rms_s: float

    def for_prompt(self, prompt: Hashable = "default") -> LayerLatency:
        """The per-layer model for requests with the given prompt label."""
        if prompt not in self.ttft_terms:
            raise KeyError(f"no TTFT samples for prompt {prompt!r}; have {list(self.ttft_terms)}")
        per_layer, other = self.ttft_terms[prompt]
        return LayerLatency(per_layer, other, self.tpot_per_layer_s, self.tpot_other_s)


def fit_layer_latency(
    samples: Sequence[LatencySample], fixed_per_layer: LayerLatencyFit | None = None
) -> LayerLatencyFit:
    """Least-squares TTFT/TPOT per layer and other from fingerprint samples.

    With ``fixed_per_layer`` the per-layer terms (TPOT, and TTFT of each prompt) are taken
    from that earlier fit and only the "other" terms are fitted: the right model for a layout whose per-layer work equals a
    reference's (pipeline stages run the same layers one after another), and one that
    keeps measurement noise from being multiplied by the layer count.

    Raises ValueError when the samples cannot determine the unknowns (for example a
    single layer count, or end-to-end samples at a single output length).
    """
    samples = [s for s in samples if s.phase not in LAYER_PHASES]
    if not samples:
        raise ValueError("no latency samples")
    prompts = list(dict.fromkeys(s.prompt for s in samples if s.phase != "tpot"))
    # Columns: tpot_layer, tpot_other, then (ttft_layer, ttft_other) per prompt.
    n_cols = 2 + 2 * len(prompts)
    design = np.zeros((len(samples), n_cols))
    target = np.array([s.seconds for s in samples], dtype=float)
    for row, s in enumerate(samples):
        tpot_weight = {"end_to_end": s.output_tokens, "tpot": 1.0, "ttft": 0.0}[s.phase]
        design[row, 0:2] = (tpot_weight * s.layers, tpot_weight)
        if s.phase != "tpot":
            col = 2 + 2 * prompts.index(s.prompt)
            design[row, col : col + 2] = (s.layers, 1.0)
    if fixed_per_layer is not None:
        missing = [p for p in prompts if p not in fixed_per_layer.ttft_terms]
        if missing:
            raise ValueError(f"fixed per-layer terms lack prompts {missing}")
        per_layer_cols = [0] + [2 + 2 * i for i in range(len(prompts))]
        per_layer_vals = [fixed_per_layer.tpot_per_layer_s] + [
            fixed_per_layer.ttft_terms[p][0] for p in prompts
        ]
        target = target - design[:, per_layer_cols] @ np.array(per_layer_vals)
        free = [c for c in range(n_cols) if c not in per_layer_cols]
    else:
        free = list(range(n_cols))
    sub = design[:, free]
    if np.linalg.matrix_rank(sub) < len(free):
        raise ValueError(
            "latency samples do not determine TTFT/TPOT per layer and other: give at least "
            "two layer counts and, for end-to-end samples, two output lengths"
        )
    solution, *_ = np.linalg.lstsq(sub, target, rcond=None)
    coef = np.zeros(n_cols)
    if fixed_per_layer is not None:
        coef[per_layer_cols] = per_layer_vals
    coef[free] = solution
    residual = target - sub @ solution
    terms = {p: (float(coef[2 + 2 * i]), float(coef[3 + 2 * i])) for i, p in enumerate(prompts)}
    return LayerLatencyFit(
        tpot_per_layer_s=float(coef[0]),
        tpot_other_s=float(coef[1]),
        ttft_terms=terms,
        residual_rms_s=float(np.sqrt(np.mean(residual**2))),
    )


@dataclass(frozen=True)
class LayerMemory:
    """Memory footprint linear in the hidden layers deployed (GiB)."""

    per_layer_gib: float
    other_gib: float

    def at(self, layers: float) -> float:
        """Footprint with ``layers`` hidden layers, GiB."""
        return layers * self.per_layer_gib + self.other_gib


def fit_layer_memory(layers: Sequence[float], memory_gib: Sequence[float]) -> LayerMemory:
    """Least-squares line through (layers, memory); needs two distinct layer counts."""
    fits = fit_layer_memory_shared({"only": (layers, memory_gib)})
    return fits["only"]


def fit_layer_memory_shared(
    groups: Mapping[Hashable, tuple[Sequence[float], Sequence[float]]],
    slope_from: Hashable | None = None,
    known_slope: float | None = None,
) -> dict[Hashable, LayerMemory]:
    """One per-layer slope shared by every group, an intercept per group (GiB).

    With ``known_slope`` (what a layer's weights and KV cache take, known from the
    architecture and the engine's formats) the samples fit only the intercepts, the
    mean of ``memory - known_slope * layers`` per group: nothing measured is multiplied
    by the layer count. Otherwise the slope is fitted as follows.

    The groups are reference layouts of the same variant. Summed over the devices, a
    layer costs the same however it is split (tensor parallelism shards its weights and
    KV cache, pipeline parallelism moves it whole), so pooling the groups averages the
    measurement noise that extrapolation multiplies by the layer count; the intercepts
    keep what differs per layout (runtime buffers, replicated activations).

    With ``slope_from`` naming a group that has two layer counts and a positive slope,
    groups whose own slope differs from that group's by more than 25 % only fit their
    intercepts: the choice when one group is measured more exactly than the rest (on
    CPU the single-rank (1,1) figure is the worker's own account of its tensors, while
    a follower rank's includes its process's resident-set growth, which moves by
    several MiB from run to run: int8 Falcon-style slopes 2.6, 4.1 and -4.3 MiB at
    (1,1), (1,2), (2,1)). Where the groups agree, they are pooled.
    """
    keys = list(groups)
    if not keys:
        raise ValueError("no memory samples")
    if known_slope is not None:
        if not known_slope > 0:
            raise ValueError(f"known_slope must be positive, got {known_slope}")
        return {
            key: LayerMemory(
                known_slope,
                float(
                    np.mean(
                        np.asarray(groups[key][1], float)
                        - known_slope * np.asarray(groups[key][0], float)
                    )
                ),
            )
            for key in keys
        }
    rows: list[np.ndarray] = []
    target: list[float] = []
    for i, key in enumerate(keys):
        layer_counts, memory = groups[key]
        if len(layer_counts) != len(memory):
            raise ValueError(
                f"group {key!r}: {len(layer_counts)} layer counts, {len(memory)} values"
            )
        for n, m in zip(layer_counts, memory, strict=True):
            row = np.zeros(1 + len(keys))
            row[0] = n
            row[1 + i] = 1.0
            rows.append(row)
            target.append(float(m))
    design = np.array(rows)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError("memory samples need two distinct layer counts in at least one group")
    coef, *_ = np.linalg.lstsq(design, np.array(target), rcond=None)
    slope = float(coef[0])
    own = {key: _own_slope(*groups[key]) for key in keys}
    bad = [key for key, x in own.items() if x is not None and x <= 0]
    good = [x for x in own.values() if x is not None and x > 0]
    chosen = own.get(slope_from) if slope_from is not None else None
    if chosen is not None and chosen > 0:
        # Layouts whose own slope strays from the trusted one measured noise too.
        bad = [
            key
            for key, x in own.items()
            if x is not None and (x <= 0 or abs(x / chosen - 1.0) > _SLOPE_TOLERANCE)
        ]
        good = [x for key, x in own.items() if x is not None and key not in bad]
    if bad and good:
        # More layers cannot hold less memory: a layout whose own slope is not positive
        # measured noise, not layers (on CPU a follower rank's figure includes its
        # process's resident-set growth, which on a small fingerprint can exceed a
        # layer's bytes: int8 Falcon-style, slopes 2.6, 4.1 and -4.3 MiB at (1,1),
        # (1,2), (2,1), and the pooled slope 0.8 MiB underestimated the full model by
        # 58 %). Such layouts keep an intercept but do not inform the slope.
        slope = float(np.median(good))
        out = {}
        for key in keys:
            layer_counts, memory = groups[key]
            other = float(np.mean(np.asarray(memory, float) - slope * np.asarray(layer_counts)))
            out[key] = LayerMemory(slope, other)
        return out
    return {key: LayerMemory(slope, float(coef[1 + i])) for i, key in enumerate(keys)}


# How far (relative) a group's own memory slope may stray from the trusted group's.
_SLOPE_TOLERANCE = 0.25


def _own_slope(layers: Sequence[float], memory: Sequence[float]) -> float | None:
    """Least-squares slope of one group; None without two distinct layer counts."""
    n = np.asarray(layers, float)
    if len(set(n.tolist())) < 2:
        return None
    m = np.asarray(memory, float)
    return float(np.sum((n - n.mean()) * (m - m.mean())) / np.sum((n - n.mean()) ** 2))


@dataclass(frozen=True)
class PooledLatencyFit:
    """Per-layer and other latency terms of every variant of one model, fitted together.

    The structure (seconds; TPOT per output token) for variant ``v`` on layout (tp, pp):

        per-layer TPOT = tpot_per_layer[v, b] / tp + tpot_comm_per_layer[tp, b]
        per-layer TTFT = ttft_per_layer[v, prompt] / tp + ttft_comm_per_layer[tp, prompt]
        other TPOT = tpot_other[(tp, pp), b],  other TTFT = ttft_other[(tp, pp), prompt]

    where ``b`` is the prompt's decode group. With layer clocks (iserve's profiler) the
    group is the prompt label itself, one prompt length at one batch size: a step that
    carries two sequences is not one that carries one (on this project's CPU devices a
    decode layer takes 1.3-1.65 ms at batch 2 against 0.96-1.08 ms at batch 1; one
    median over both put the batch-1 TPOT of every full model 10-17 % high, and the
    batch-2 overhead at zero), and a step that reads a longer context is not one that
    reads a short one (a hidden-256 model's decode took 1.04 ms after a 200-token prompt,
    1.87 after 1,024 and 5.77 after 8,192; one median over the profiled 64-1,024 tokens
    held every prompt's TPOT at 1.2 ms). From end-to-end timings
    alone every prompt shares one group: on the A6000 data batch-2 decode costs what
    batch 1 does within noise, and keeping them apart there made held-out latency worse
    (LOAO 2.2 / 6.5 % -> 2.5 / 6.7 %, scale transfer 2.2 / 5.6 -> 2.6 / 6.4).

    Tensor parallelism splits a layer's work over tp devices and adds an all-reduce whose
    cost depends on the activations (hidden size, tokens), not on how the weights are
    quantized, so the communication terms are shared by every variant; so are the
    "other" terms (embeddings, LM head, runtime), which weight-only quantization leaves
    alone. Pipeline parallelism at batch size 1 runs the stages one after another: a
    layer costs the same for every pp, and stage boundaries land in the "other" terms.
    Sharing is what makes the fit robust: each variant contributes samples to the
    common terms instead of extrapolating its own two noisy points by the layer count.
    """

    tpot_per_layer_s: Mapping[Hashable, float]
    ttft_per_layer_s: Mapping[tuple[Hashable, Hashable], float]
    tpot_comm_per_layer_s: Mapping[int, float]
    ttft_comm_per_layer_s: Mapping[tuple[int, Hashable], float]
    tpot_other_s: Mapping[tuple[tuple[int, int], Hashable], float]
    ttft_other_s: Mapping[tuple[tuple[int, int], Hashable], float]
    residual_rms_s: float
    decode_group: Mapping[Hashable, Hashable]

    def batch_of(self, prompt: Hashable) -> Hashable:
        """The group of ``prompt`` whose TPOT terms it uses: the label itself when the
        per-layer terms came from layer clocks, 1 (one group) otherwise."""
        try:
            return self.decode_group[prompt]
        except KeyError:
            raise KeyError(f"no samples for prompt {prompt!r}") from None

    def layer_latency(
        self, variant: Hashable, layout: tuple[int, int], prompt: Hashable
    ) -> LayerLatency:
        """Per-layer model of ``variant`` on ``layout`` for requests with ``prompt``."""
        ttft_layer, tpot_layer = self.per_layer_s(variant, layout[0], prompt)
        try:
            return LayerLatency(
                ttft_per_layer_s=ttft_layer,
                ttft_other_s=self.ttft_other_s[(layout, prompt)],
                tpot_per_layer_s=tpot_layer,
                tpot_other_s=self.tpot_other_s[(layout, self.batch_of(prompt))],
            )
        except KeyError as missing:
            raise KeyError(
                f"no fitted term {missing} for variant {variant!r}, layout {layout}, prompt {prompt!r}"
            ) from None

    def per_layer_s(self, variant: Hashable, tp: int, prompt: Hashable) -> tuple[float, float]:
        """(TTFT, TPOT) of one layer of ``variant`` at tensor degree ``tp``, seconds."""
        try:
            batch = self.batch_of(prompt)
            return (
                self.ttft_per_layer_s[(variant, prompt)] / tp
                + (self.ttft_comm_per_layer_s[(tp, prompt)] if tp > 1 else 0.0),
                self.tpot_per_layer_s[(variant, batch)] / tp
                + (self.tpot_comm_per_layer_s[(tp, batch)] if tp > 1 else 0.0),
            )
        except KeyError as missing:
            raise KeyError(
                f"no fitted term {missing} for variant {variant!r}, tp={tp}, prompt {prompt!r}"
            ) from None


def _solve_pooled(
    samples: Mapping[tuple[Hashable, tuple[int, int]], Sequence[LatencySample]],
    fixed: PooledLatencyFit | None,
    decode_group: Mapping[Hashable, Hashable],
) -> tuple[dict[str, dict], float]:
    """Least squares for the pooled terms; with ``fixed``, per-layer terms come from it.
    ``decode_group`` maps each prompt label to the group whose TPOT terms it shares."""
    columns: dict[tuple, int] = {}

    def col(key: tuple) -> int:
        return columns.setdefault(key, len(columns))

    entries: list[dict[int, float]] = []
    target: list[float] = []
    for (variant, layout), layout_samples in samples.items():
        tp = layout[0]
        for s in layout_samples:
            if s.phase in LAYER_PHASES:
                continue  # see _clock_terms
            row: dict[int, float] = {}
            known = 0.0
            tpot_weight = {"end_to_end": float(s.output_tokens), "tpot": 1.0, "ttft": 0.0}[s.phase]
            per_layer = None if fixed is None else fixed.per_layer_s(variant, tp, s.prompt)
            if tpot_weight:
                if per_layer is None:
                    group = decode_group[s.prompt]
                    row[col(("tpot_layer", variant, group))] = tpot_weight * s.layers / tp
                    if tp > 1:
                        row[col(("tpot_comm", tp, group))] = tpot_weight * s.layers
                else:
                    known += tpot_weight * s.layers * per_layer[1]
                row[col(("tpot_other", layout, decode_group[s.prompt]))] = tpot_weight
            if s.phase != "tpot":
                if per_layer is None:
                    row[col(("ttft_layer", variant, s.prompt))] = s.layers / tp
                    if tp > 1:
                        row[col(("ttft_comm", tp, s.prompt))] = float(s.layers)
                else:
                    known += s.layers * per_layer[0]
                row[col(("ttft_other", layout, s.prompt))] = 1.0
            entries.append(row)
            target.append(s.seconds - known)
    design = np.zeros((len(entries), len(columns)))
    for i, row in enumerate(entries):
        for j, value in row.items():
            design[i, j] = value
    if np.linalg.matrix_rank(design) < len(columns):
        raise ValueError(
            "fingerprint samples do not determine the latency terms: every variant needs "
            "samples at (1, 1) with two layer counts (and two output lengths for end-to-end "
            "samples) at each batch size, every (tp, 1) used two layer counts"
        )
    coef, *_ = np.linalg.lstsq(design, np.array(target), rcond=None)
    residual = np.array(target) - design @ coef
    terms: dict[str, dict] = {name: {} for name in _POOLED_TERMS}
    for key, j in columns.items():
        name, *rest = key
        terms[name][rest[0] if len(rest) == 1 else tuple(rest)] = float(coef[j])
    return terms, float(np.sum(residual**2))


_POOLED_TERMS = ("tpot_layer", "ttft_layer", "tpot_comm", "ttft_comm", "tpot_other", "ttft_other")


def _clock_terms(
    flat: Mapping[tuple[Hashable, tuple[int, int]], Sequence[LatencySample]],
) -> dict[str, dict] | None:
    """Per-layer terms from layer-clock samples alone, or None when they do not cover
    every pp = 1 layout's phases and prompts (then the layer counts decide).

    A variant's per-layer work is the median of its (1,1) clock samples (of its
    fingerprints of more than one layer, when it has them); the
    communication term of each tp > 1 is the median, over every variant's (tp, 1)
    samples, of what they show beyond that work split tp ways. Medians and this order,
    not one joint least-squares fit: a tp = 2 layer on two CPU cores (a gloo all-reduce
    per block) wanders by 20-30 % from run to run, and a joint fit let that noise move
    the per-layer work of every variant.
    """

    def clocks(samples: Sequence[LatencySample], phase: str, key: Hashable) -> list[float]:
        # TTFT and TPOT clocks per prompt label (a label is one prompt length and one
        # batch size): decode reads the whole context each step, so a longer prompt's
        # steps take longer. A stage of several layers times those after the first (see
        # monitor_agent.engine.layer_clock), a one-layer stage its one, which also
        # carries the forward's cold start: the longer stages' clocks when there are any.
        timed = [s for s in samples if s.phase == f"{phase}_layer" and s.prompt == key]
        longer = [s.seconds for s in timed if s.layers > 1]
        return longer or [s.seconds for s in timed]

    def keys_of(samples: Sequence[LatencySample], phase: str) -> set[Hashable]:
        # The prompt labels a layout's TPOT or TTFT was timed with.
        return {s.prompt for s in samples if s.phase in (phase, "end_to_end")}

    terms: dict[str, dict] = {name: {} for name in _POOLED_TERMS}
    beyond: dict[tuple, list[float]] = defaultdict(list)
    # The (1,1) work first: each tp > 1 term is what its clocks show beyond it.
    for (variant, (tp, _)), samples in sorted(flat.items(), key=lambda item: item[0][1][0] != 1):
        for phase in ("tpot", "ttft"):
            work = terms[f"{phase}_layer"]
            for key in keys_of(samples, phase):
                values = clocks(samples, phase, key)
                if not values or (tp > 1 and (variant, key) not in work):
                    return None
                if tp == 1:
                    work[(variant, key)] = float(np.median(values))
                else:
                    share = work[(variant, key)] / tp
                    beyond[(f"{phase}_comm", tp, key)] += [v - share for v in values]
    for (name, *key), values in beyond.items():
        terms[name][tuple(key)] = float(np.median(values))
    return terms


def fit_pooled_latency(
    samples: Mapping[tuple[Hashable, tuple[int, int]], Sequence[LatencySample]],
) -> PooledLatencyFit:
    """Fit :class:`PooledLatencyFit` by least squares over every variant and layout.

    ``samples`` maps (variant, (tp, pp)) to that fingerprint's samples. The per-layer
    terms come from the pp = 1 layouts only; layouts with pp > 1 then contribute their
    "other" terms. Pipeline fingerprints are too short to show a layer's cost (with 2
    and 3 layers over 2 stages their per-layer increments come out 20 % low on the
    A6000 data), while what pp adds (stage boundaries) does not scale with layers.

    When every pp = 1 layout also has layer-clock samples (``ttft_layer`` and
    ``tpot_layer`` for each prompt it was timed with), the per-layer terms come from
    those alone and the layer counts only fit the "other" terms. A layer timed inside a
    run does not carry the run-to-run noise that the difference between two separately
    timed fingerprints does, which extrapolation multiplies by the layer count (on
    2 CPU cores a 1- and a 2-layer fingerprint's TPOT each wander by 5-15 %).

    Every variant needs (1, 1) samples with two layer counts; every (tp, pp) layout
    needs its (tp, 1) counterpart. Raises ValueError otherwise.
    """
    if not any(samples.values()):
        raise ValueError("no latency samples")
    flat = {key: value for key, value in samples.items() if key[1][1] == 1}
    staged = {key: value for key, value in samples.items() if key[1][1] > 1}
    for variant, (tp, pp) in staged:
        if (variant, (tp, 1)) not in flat:
            raise ValueError(
                f"variant {variant!r}: layout {(tp, pp)} needs samples at {(tp, 1)} too"
            )
    batches = _prompt_batches(samples)
    clock = _clock_terms(flat)
    # Layer clocks time a decode step at each batch size as it is; end-to-end timings
    # share one set of TPOT terms over every batch size profiled (item 3 of
    # docs/estimation.md: on the A6000 data batch-2 decode costs what batch 1 does
    # within noise, and its samples halve the TPOT noise).
    groups = {label: label for label in batches} if clock is not None else dict.fromkeys(batches, 1)
    fixed = None if clock is None else _pooled_from_terms(clock, 0.0, 0, groups)
    terms, sse = _solve_pooled(flat, fixed, groups)
    if clock is not None:
        for name in ("tpot_layer", "ttft_layer", "tpot_comm", "ttft_comm"):
            terms[name] = clock[name]
    else:
        robust = _robust_comm_terms(flat, terms, groups)
        if robust != {name: terms[name] for name in robust}:
            terms.update(robust)
            refit, sse = _solve_pooled(flat, _pooled_from_terms(terms, 0.0, 0, groups), groups)
            for name in ("tpot_other", "ttft_other"):
                terms[name] = refit[name]
    count = sum(len(v) for v in flat.values())
    fit = _pooled_from_terms(terms, sse, count, groups)
    if staged:
        staged_terms, staged_sse = _solve_pooled(staged, fit, groups)
        for name in ("tpot_other", "ttft_other"):
            terms[name].update(staged_terms[name])
        count += sum(len(v) for v in staged.values())
        fit = _pooled_from_terms(terms, sse + staged_sse, count, groups)
    return fit


def _prompt_batches(
    samples: Mapping[tuple[Hashable, tuple[int, int]], Sequence[LatencySample]],
) -> dict[Hashable, int]:
    """Each prompt label's batch size; a label used at two batch sizes is refused (its
    TTFT terms would mix two kinds of step)."""
    seen: dict[Hashable, set[int]] = defaultdict(set)
    for rows in samples.values():
        for s in rows:
            seen[s.prompt].add(s.batch)
    mixed = {prompt: sorted(b) for prompt, b in seen.items() if len(b) > 1}
    if mixed:
        raise ValueError(f"prompt labels with samples at several batch sizes: {mixed}")
    return {prompt: next(iter(b)) for prompt, b in seen.items()}


def _robust_comm_terms(
    flat: Mapping[tuple[Hashable, tuple[int, int]], Sequence[LatencySample]],
    terms: Mapping[str, Mapping],
    decode_group: Mapping[Hashable, Hashable],
) -> dict[str, dict]:
    """The communication terms per tensor degree as the median over the variants of
    what each variant's own (tp, 1) fingerprints show beyond its work split tp ways,
    then no lower than what the tp = 2 term implies for more peers.

    A joint least-squares fit averages the variants, so one variant whose two
    fingerprints timed badly moves the term of all of them (Llama-2-13B on the A6000
    data at tp = 8: per-layer TTFT increments of 2.1-3.0 ms for five variants and 7.0 ms
    for int4; the mean set every variant's tp = 8 TTFT 48 % high, the median 17 %).
    The floor: a ring all-reduce moves ``2 (tp - 1) / tp`` times its message per device
    (1 at tp = 2, 1.5 at tp = 4, 1.75 at tp = 8) in ``2 (tp - 1)`` steps, so per layer it
    cannot cost less at tp peers than ``2 (tp - 1) / tp`` times its cost at tp = 2 over
    the same links (Llama-2-13B at tp = 4: fingerprints show 1.47 ms a layer, below the
    1.45 ms of its work split four ways plus 1.5 x the 0.59 ms tp = 2 all-reduce; the
    full model measured 2.25 ms).
    """
    increments: dict[tuple, list[float]] = defaultdict(list)
    for (variant, (tp, _)), layout_samples in flat.items():
        if tp <= 2:
            continue
        for group in sorted({decode_group[s.prompt] for s in layout_samples}):
            samples = [s for s in layout_samples if decode_group[s.prompt] == group]
            try:
                own = fit_layer_latency([s for s in samples if s.phase not in LAYER_PHASES])
            except ValueError:
                continue  # one layer count only: the joint fit's term stands
            if (variant, group) in terms["tpot_layer"]:
                work = terms["tpot_layer"][(variant, group)] / tp
                increments[("tpot_comm", tp, group)].append(own.tpot_per_layer_s - work)
            for prompt, (per_layer, _) in own.ttft_terms.items():
                if (variant, prompt) in terms["ttft_layer"]:
                    work = terms["ttft_layer"][(variant, prompt)] / tp
                    increments[("ttft_comm", tp, prompt)].append(per_layer - work)
    robust: dict[str, dict] = {
        "tpot_comm": dict(terms["tpot_comm"]),
        "ttft_comm": dict(terms["ttft_comm"]),
    }
    for (name, *key), values in increments.items():
        robust[name][tuple(key)] = float(np.median(values))
    for name in ("tpot_comm", "ttft_comm"):
        for key, value in list(robust[name].items()):
            tp = key[0]
            at_two = robust[name].get((2, *key[1:]))
            if tp > 2 and at_two is not None and at_two > 0:
                robust[name][key] = max(value, at_two * 2.0 * (tp - 1) / tp)
    return robust


def _pooled_from_terms(
    terms: dict[str, dict], sse: float, count: int, decode_group: Mapping[Hashable, Hashable]
) -> PooledLatencyFit:
    """The fit from its terms; ``decode_group`` maps each prompt to its TPOT group."""
    return PooledLatencyFit(
        tpot_per_layer_s=terms["tpot_layer"],
        ttft_per_layer_s=terms["ttft_layer"],
        tpot_comm_per_layer_s=terms["tpot_comm"],
        ttft_comm_per_layer_s=terms["ttft_comm"],
        tpot_other_s=terms["tpot_other"],
        ttft_other_s=terms["ttft_other"],
        residual_rms_s=float(np.sqrt(sse / max(count, 1))),
        decode_group=dict(decode_group),
    )
