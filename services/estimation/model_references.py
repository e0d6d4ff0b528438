"""A model's samples to its full-model references per prompt length, and estimates.

:func:`model_references` extrapolates the fingerprint samples of one model on one
hardware type (``services.estimation.references``) for every prompt length profiled,
with the batch model's batch-2 references when batch 2 was profiled; :func:`estimate`
scores every configuration of one workload from them.

Samples with another prompt label (``(input tokens, batch size)``) than the one
extrapolated for share the TPOT terms of the fit (from end-to-end timings; layer clocks
keep each label's own) and have TTFT terms of their own, so a
short-prompt profile at batch 1 and 2 sharpens the TPOT of one taken with a long prompt
and gives the batch model its per-sequence overhead. A label with ``input_tokens = 0``
(not recorded) never stands for a deployment's prompt when a recorded one exists.

Pure: no gRPC, Redis or I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from services.contention import contention_note
from services.estimation.extrapolate import LatencySample
from services.estimation.latency import (
    BASE,
    PIPELINE,
    REFERENCE_BATCHES,
    REFERENCE_LAYOUTS,
    TENSOR,
)
from services.estimation.profiles import Sample
from services.estimation.prompt_curve import (
    attention_share,
    gated_layer_weights,
    one_length,
    profiles_at,
    recorded,
)
from services.estimation.references import (
    ReferenceProfile,
    VariantProfile,
    extrapolate_references,
)
from services.estimation.score import Calibration, Estimates, estimate_space
from services.estimation.space import ModelShape, Variant, enumerate_space, parallel_pairs

__all__ = [
    "ModelReferences",
    "PromptReferences",
    "Workload",
    "estimate",
    "model_references",
]

Layout = tuple[int, int]


@dataclass(frozen=True)
class PromptReferences:
    """Every variant's references extrapolated for one profiled prompt length.

    ``profiles`` follows :attr:`ModelReferences.variants`; ``kv_tokens_profiled`` is
    the KV cache (tokens) the profiled memory already holds.
    """

    input_tokens: int
    kv_tokens_profiled: int
    profiles: tuple[VariantProfile, ...]


def unprofiled_note(layout: Layout, input_tokens: int | None = None) -> str:
    """The note of a model whose fingerprints were never run at ``layout`` (TENSOR or
    PIPELINE), or never with a prompt of ``input_tokens``."""
    kind = "tensor" if layout == TENSOR else "pipeline"
    prompt = "" if input_tokens is None else f" with the {input_tokens}-token prompt"
    return (
        f"{_unprofiled_at(layout)}{prompt}: {kind}-parallel "
        f"configurations are estimated without its communication cost{prompt and ' there'}"
    )


def _unprofiled_at(layout: Layout) -> str:
    """How every :func:`unprofiled_note` of ``layout`` starts."""
    return f"no fingerprint runs at tp={layout[0]} pp={layout[1]}"


def _profiled_with(fingerprints: Sequence[Sample], layout: Layout, input_tokens: int) -> bool:
    """Whether ``layout`` was profiled at batch 1 with a prompt of ``input_tokens``
    (its TTFT terms exist for that prompt)."""
    return any(
        s.layout == layout and s.batch == 1 and s.input_tokens == input_tokens for s in fingerprints
    )


@dataclass(frozen=True)
class ModelReferences:
    """A model's full-model reference figures on one hardware type, per prompt length.

    ``layouts`` are those of every :class:`ReferenceProfile`: the three references,
    then TP-ladder layouts (tp, 1) with tp > 2 when profiled. ``prompts`` are sorted by
    prompt length.
    """

    shape: ModelShape
    variants: tuple[Variant, ...]
    layouts: tuple[Layout, ...]
    prompts: tuple[PromptReferences, ...]
    notes: tuple[str, ...] = ()

    @property
    def variant_keys(self) -> tuple[str, ...]:
        """The profile's variant names, aligned with ``variants``."""
        return tuple(v.name for v in self.variants)

    def communication_unprofiled(self, tp: np.ndarray, pp: np.ndarray) -> np.ndarray:
        """Per configuration (``tp``, ``pp`` arrays), whether it splits the model a way
        whose communication the fingerprints never ran (:func:`unprofiled_note`)."""
        unprofiled = np.zeros(np.shape(tp), dtype=bool)
        for layout, degree in ((TENSOR, tp), (PIPELINE, pp)):
            # Never profiled there, or not with one of the prompts (estimates between
            # prompts interpolate through it).
            if any(note.startswith(_unprofiled_at(layout)) for note in self.notes):
                unprofiled |= np.asarray(degree) > 1
        return unprofiled

    @property
    def has_tp_ladder(self) -> bool:
        return len(self.layouts) > len(REFERENCE_LAYOUTS)

    def default_input_tokens(self, output_tokens: int = 0) -> int:
        """The prompt length estimates use when the workload gives none: the longest
        profiled that leaves the model's context room for ``output_tokens``, else what
        room there is (at least 1: a context the output fills alone is refused where the
        positions are checked)."""
        room = self.shape.max_positions - output_tokens if self.shape.max_positions else None
        fitting = [p.input_tokens for p in self.prompts if room is None or p.input_tokens <= room]
        if fitting:
            return fitting[-1]
        return max(1, room)

    def without_tp_ladder(self) -> ModelReferences:
        """The same references restricted to the three reference layouts."""
        if not self.has_tp_ladder:
            return self

        def cut(p: ReferenceProfile) -> ReferenceProfile:
            return ReferenceProfile(REFERENCE_LAYOUTS, p.ttft_s[:3], p.tpot_s[:3], p.memory_gib[:3])

        prompts = tuple(
            replace(
                prompt,
                profiles=tuple(
                    replace(
                        v, batch1=cut(v.batch1), batch2=None if v.batch2 is None else cut(v.batch2)
                    )
                    for v in prompt.profiles
                ),
            )
            for prompt in self.prompts
        )
        return replace(self, layouts=REFERENCE_LAYOUTS, prompts=prompts)

    def batch_note(self, batch_size: int, measured_growth: bool = False) -> str | None:
        """What an estimate for ``batch_size`` sequences stands on, beyond the batches
        profiled (None for batch 1 and 2); ``measured_growth``: the calibration has the
        hardware's decode growth per further sequence (score.Calibration.tpot_batch_growth)."""
        if batch_size <= 2:
            return None
        growth = (
            "; TPOT grows at least by the share per further sequence the hardware's "
            "full-model batch sweeps measured (its calibration's, where it has one for the "
            "weight format and tensor degree)"
        )
        if not all(v.batch2 is not None for p in self.prompts for v in p.profiles):
            return (
                f"batch {batch_size}: no batch-2 profile, so each further sequence adds "
                "only its KV cache's memory and nothing to TTFT"
                + (growth if measured_growth else " or TPOT")
            )
        return (
            f"batch {batch_size} is extrapolated linearly from the profiled batches 1 and 2 "
            "(MaverIQ Eq. 6), each further sequence's TTFT at least its prompt's prefill "
            "beyond the batch-2 runs' prompt; a parallel layout's per-sequence overhead is at "
            "least (1,1)'s over its tensor degree"
            + (
                growth
                if measured_growth
                else ". Decode's KV-cache reads grow faster than that line at large batches: "
                "read TPOT beyond a few dozen sequences as a lower bound"
            )
        )

    def prompt_note(self, input_tokens: int) -> str | None:
        """What an estimate for an ``input_tokens`` prompt outside the profiled prompt
        lengths stands on (None inside them): see :meth:`at_input`."""
        lengths = [p.input_tokens for p in self.prompts]
        if lengths[0] <= input_tokens <= lengths[-1]:
            return None
        profiled = ", ".join(str(n) for n in lengths)
        known = len(recorded(lengths))
        if input_tokens > lengths[-1] and known >= 2 and _attention_share(self.shape):
            return (
                f"a {input_tokens}-token prompt is longer than the prompts profiled "
                f"({profiled} tokens): TTFT is extrapolated from the {lengths[-2]}- and "
                f"{lengths[-1]}-token prompts' along prefill's shape (its weights' work grows "
                "linearly with the prompt, its attention's quadratically, in the ratio the "
                "architecture sets); TPOT and memory follow the line through the two "
                "longest (decode reads the whole context each step; a prefill's "
                "activations grow with its prompt)"
            )
        if input_tokens > lengths[-1] and known >= 3:
            return (
                f"a {input_tokens}-token prompt is longer than the prompts profiled "
                f"({profiled} tokens): TTFT is extrapolated along the parabola through the "
                f"{lengths[-3]}-, {lengths[-2]}- and {lengths[-1]}-token prompts' (prefill's "
                "weights grow linearly with the prompt, its attention quadratically), no "
                "lower than the line through the two longest; TPOT is the profiled prompts' fit; "
                "memory follows the line through the two longest (a prefill's activations grow "
                "with its prompt)"
            )
        if one_length(lengths) and 0 < input_tokens != lengths[-1] and _attention_share(self.shape):
            longer = input_tokens > lengths[-1]
            return (
                f"a {input_tokens}-token prompt is {'longer' if longer else 'shorter'} than "
                f"the one prompt length profiled ({lengths[-1]} tokens): TTFT "
                f"{'grows' if longer else 'falls'} from it with prefill's work (its weights' "
                "linearly with the prompt, its attention's quadratically, in the ratio the "
                "architecture sets), along the line through it and a one-token prompt, whose "
                "prefill is a decode step (TPOT; a TTFT split out of end-to-end latencies also "
                "holds the first token's step, so at one token it reads two TPOTs); "
                f"TPOT is the {lengths[-1]}-token prompt's"
                + (
                    " (decode's reads of a longer context are not in it: a lower bound)"
                    if longer
                    else ""
                )
                + f"; memory holds the KV cache of {input_tokens} tokens plus the output"
            )
        if input_tokens > lengths[-1] and known == 2:
            return (
                f"a {input_tokens}-token prompt is longer than the prompts profiled "
                f"({profiled} tokens): TTFT is extrapolated along the line through the "
                f"{lengths[-2]}- and {lengths[-1]}-token prompts' (attention's quadratic share "
                "of prefill makes a very long prompt's TTFT a lower bound); TPOT is the "
                "profiled prompts' fit; memory follows the same line"
            )
        nearest = lengths[0] if input_tokens < lengths[0] else lengths[-1]
        return (
            f"a {input_tokens}-token prompt is outside the prompt lengths profiled "
            f"({profiled} tokens): TTFT and TPOT are the {nearest}-token prompt's, not "
            f"extrapolated; memory holds the KV cache of {input_tokens} tokens plus the output"
        )

    def at_input(self, input_tokens: int) -> tuple[VariantProfile, ...]:
        """Variant profiles for a prompt of ``input_tokens`` tokens, along the profiled
        prompt lengths' curve (:func:`services.estimation.prompt_curve.profiles_at`).
        With layer clocks each profiled prompt has its own TPOT, so TPOT follows the
        prompt too (the line through the two longest beyond them); from end-to-end
        timings the labels share one, which moves only by what the floor of
        :func:`_at_least_measured` lifted."""
        return profiles_at(
            [p.input_tokens for p in self.prompts],
            [p.profiles for p in self.prompts],
            input_tokens,
            _attention_share(self.shape),
        )


def _attention_share(shape: ModelShape) -> float | None:
    """Prefill's quadratic share for ``shape`` (:func:`attention_share`): over the layer's
    weights as its checkpoint counts them, else (a shape without them) over a gated
    MLP's; None when neither is known (a shape imported from measurements alone)."""
    hidden = shape.num_heads * shape.head_dim
    weights = shape.layer_weights
    if weights <= 0 and shape.mlp_width > 0:
        weights = gated_layer_weights(hidden, shape.num_kv_heads * shape.head_dim, shape.mlp_width)
    return attention_share(hidden, weights) if weights > 0 else None


def _ladder_layouts(fingerprints: Sequence[Sample]) -> tuple[Layout, ...]:
    return tuple(sorted({s.layout for s in fingerprints if s.pp == 1 and s.tp > 2}))


def _prompts_of_every_variant(
    fingerprints: Sequence[Sample], variants: Sequence[str], batch: int
) -> set[int]:
    """Input lengths profiled at (1,1) with ``batch`` for every variant (TTFT-bearing)."""
    per_variant: dict[str, set[int]] = defaultdict(set)
    for s in fingerprints:
        if s.layout == BASE and s.batch == batch and (s.direct_phases or s.latency_s > 0):
            per_variant[s.variant].add(s.input_tokens)
    common_lengths = [per_variant[v] for v in variants]
    return set.intersection(*common_lengths) if common_lengths else set()


def _memory_groups(
    fingerprints: Sequence[Sample], layouts: Sequence[Layout], input_tokens: int
) -> tuple[dict[tuple[str, Layout], tuple[list[int], list[float]]], int, dict[str, float]]:
    """Memory samples per (variant, layout) of prompt ``(input_tokens, 1)`` and the KV
    cache they hold, in tokens (the longest prompt + output among them: a static cache
    is sized for it, a paged one holds about that much); a variant without such samples
    at (1,1) uses its batch-1 samples of any prompt."""
    chosen: dict[tuple[str, Layout], list[Sample]] = defaultdict(list)
    fallback: dict[tuple[str, Layout], list[Sample]] = defaultdict(list)
    for s in fingerprints:
        if s.layout not in layouts or s.batch != 1 or s.memory_gib <= 0:
            continue
        fallback[(s.variant, s.layout)].append(s)
        if s.input_tokens == input_tokens:
            chosen[(s.variant, s.layout)].append(s)
    variants = {v for v, _ in fallback}
    groups: dict[tuple[str, Layout], list[Sample]] = {}
    for v in variants:
        source = chosen if (v, BASE) in chosen else fallback
        groups.update({key: rows for key, rows in source.items() if key[0] == v})
    used = [s for rows in groups.values() for s in rows]
    kv_tokens = max((s.input_tokens + s.output_tokens for s in used), default=0)
    memory = {
        key: ([s.layers for s in rows], [s.memory_gib for s in rows])
        for key, rows in groups.items()
    }
    return memory, kv_tokens, _known_slopes(used, kv_tokens)


def _known_slopes(used: Sequence[Sample], kv_tokens: int) -> dict[str, float]:
    """Per variant, what one decoder layer holds summed over the ranks (GiB): its
    weights and the KV cache of ``kv_tokens`` tokens, as the measurements' engine stores
    them. Variants whose measurements do not say are left out (their slope is fitted)."""
    slopes = {}
    for variant in {s.variant for s in used}:
        mine = [s for s in used if s.variant == variant]
        if all(s.layer_weight_gib > 0 and s.layer_kv_gib_per_token > 0 for s in mine):
            weights = float(np.median([s.layer_weight_gib for s in mine]))
            kv = float(np.median([s.layer_kv_gib_per_token for s in mine]))
            slopes[variant] = weights + kv * kv_tokens
    return slopes


def _kv_gib_per_token(fingerprints: Sequence[Sample], num_layers: int) -> dict[str, float]:
    """Per variant, the K and V one token holds in all ``num_layers`` layers (unsharded,
    GiB) as the measurements' engine stores them (their recorded layer bytes: the dtype
    the workers computed in, int8 with its scales); variants whose measurements do not
    say are left out (scoring then takes the architecture's 16-bit figure)."""
    out = {}
    for variant in {s.variant for s in fingerprints}:
        known = [s.layer_kv_gib_per_token for s in fingerprints if s.variant == variant]
        if known and all(k > 0 for k in known):
            out[variant] = float(np.median(known)) * num_layers
    return out


def _at_least_measured(
    profile: ReferenceProfile, fingerprints: Sequence[Sample], variant: str, input_tokens: int
) -> ReferenceProfile:
    """``profile`` raised, per layout, to what the largest fingerprint there measured
    directly (mean TTFT and TPOT from timestamps at this prompt and batch 1; memory): the
    full model holds at least as many layers, so it cannot be faster or smaller. Only
    noise makes the extrapolation fall below it (a tiny model's extra layer that timed
    faster), and then the measurement is the better estimate."""
    largest: dict[Layout, list[Sample]] = {}
    for s in fingerprints:
        if s.variant != variant or s.layout not in profile.layouts or s.batch != 1:
            continue
        kept = largest.get(s.layout)
        if kept is None or s.layers > kept[0].layers:
            largest[s.layout] = [s]
        elif s.layers == kept[0].layers:
            kept.append(s)
    floors = {name: [0.0] * len(profile.layouts) for name in ("ttft_s", "tpot_s", "memory_gib")}
    for layout, runs in largest.items():
        i = profile.layouts.index(layout)
        timed = [s for s in runs if s.direct_phases and s.input_tokens == input_tokens]
        if timed:
            floors["ttft_s"][i] = float(np.mean([s.ttft_s for s in timed]))
            floors["tpot_s"][i] = float(np.mean([s.tpot_s for s in timed]))
        floors["memory_gib"][i] = float(np.mean([s.memory_gib for s in runs]))

    def raised(name: str) -> tuple[float, ...]:
        values = getattr(profile, name)
        # NaN (a TP-ladder figure left to Eq. 2) stays NaN.
        return tuple(
            v if np.isnan(v) else max(v, f) for v, f in zip(values, floors[name], strict=True)
        )

    return ReferenceProfile(
        profile.layouts, raised("ttft_s"), raised("tpot_s"), raised("memory_gib")
    )


def _batch2(
    main: ReferenceProfile,
    one: ReferenceProfile,
    two: ReferenceProfile,
    longer_prompt: bool = False,
) -> ReferenceProfile:
    """Batch-2 references: ``main`` plus the per-sequence overhead measured at another
    prompt (``two - one`` at the three references). A TP-ladder layout takes the (2,1)
    overhead scaled by 2/tp: the extra sequence's work is split over the group.

    ``longer_prompt``: ``main``'s prompt is longer than the one profiled at batch 2
    (MaverIQ's batch-2 rows are its short-prompt runs). The further sequence then costs
    at least the prefill of what its prompt has beyond the short one, ``main - one`` at
    batch 1: a short prompt's batch-2 TTFT overhead is about nothing, and charged to a
    923-token prompt it made TTFT flat in the batch (a 70B model prefilling 64 such
    prompts in 0.44 s on four A6000s, where the compute alone takes over 10 s)."""
    ttft, tpot = list(main.ttft_s), list(main.tpot_s)
    at = {layout: i for i, layout in enumerate(main.layouts)}

    # The (1,1) overheads, the other references' floor over their tensor degree: the extra
    # sequence's work does not vanish in a parallel layout. A layout whose own batch-2
    # difference timed within noise (about nothing) had batch 64 decode as fast as batch
    # 1 while (1,1)'s grew 19-fold, and a throughput intent could pick it (a probe).
    def overhead(phase_one: tuple, phase_two: tuple, j: int) -> float:
        measured, base = phase_two[j] - phase_one[j], phase_two[0] - phase_one[0]
        if j and base > 0:
            return max(measured, base / REFERENCE_LAYOUTS[j][0])
        return measured

    for i, layout in enumerate(main.layouts):
        j = REFERENCE_LAYOUTS.index(layout) if layout in REFERENCE_LAYOUTS else 1
        share = 1.0 if layout in REFERENCE_LAYOUTS else TENSOR[0] / layout[0]
        reference = REFERENCE_LAYOUTS[j]
        prefill = overhead(one.ttft_s, two.ttft_s, j)
        if longer_prompt and reference in at:
            prefill = max(prefill, main.ttft_s[at[reference]] - one.ttft_s[j])
        ttft[i] += share * prefill
        tpot[i] += share * overhead(one.tpot_s, two.tpot_s, j)
    return ReferenceProfile(main.layouts, tuple(ttft), tuple(tpot), main.memory_gib)


def model_references(
    shape: ModelShape,
    variants: Mapping[str, Variant],
    samples: Iterable[Sample],
    use_tp_ladder: bool = True,
) -> ModelReferences:
    """Extrapolate the fingerprint ``samples`` of one model on one hardware type.

    ``variants`` maps the samples' variant keys to estimation variants (those not in it
    are ignored). Per recorded prompt length profiled for every variant at (1,1) and
    batch 1, the references follow ``docs/estimation.md``: one pooled fit over every
    variant and layout (pp = 1 layouts for the per-layer terms), memory from the rows of
    that prompt, TP-ladder layouts (tp, 1) with tp > 2 when profiled and
    ``use_tp_ladder`` (their TPOT only when measured from token timestamps: end-to-end
    TPOT of a one-layer fingerprint is below the timing noise). Batch-2 references come
    from a prompt profiled at batch 1 and 2 for every variant, when there is one.

    Raises ValueError when the samples cannot determine the references.
    """
    samples = [s for s in samples if s.variant in variants]
    fingerprints = [s for s in samples if not s.full_model]
    # A model of few layers is its own largest fingerprint (the profiler caps pp + 1
    # layers at the model's count): its full-model runs join a layout whose fingerprints
    # have a single layer count, or have none because the model is no deeper than that
    # layout's pp + 1 (a 2-layer model at pp = 2). Elsewhere full-model runs stay out of
    # the fit (a measured 32-layer model is what is being estimated, not a fingerprint).
    counts: dict[tuple[str, Layout], set[int]] = defaultdict(set)
    for s in fingerprints:
        counts[(s.variant, s.layout)].add(s.layers)
    fingerprints += [
        s
        for s in samples
        if s.full_model and (len(counts[(s.variant, s.layout)]) == 1 or s.layers <= s.pp + 1)
    ]
    keys = [v for v in variants if any(s.variant == v and s.layout == BASE for s in fingerprints)]
    notes = [
        f"variant {variants[v].name!r} has no fingerprint runs at tp=1 pp=1; left out"
        for v in variants
        if v not in keys
    ]
    if not keys:
        raise ValueError("no variant has fingerprint runs at the (1,1) reference")
    fingerprints = [s for s in fingerprints if s.variant in keys]
    profiled = {s.layout for s in fingerprints}
    runnable = parallel_pairs(shape, 2)
    for layout in (TENSOR, PIPELINE):
        if layout in runnable and layout not in profiled:
            notes.append(unprofiled_note(layout))
    ladder = _ladder_layouts(fingerprints) if use_tp_ladder else ()
    layouts = REFERENCE_LAYOUTS + ladder
    latency: dict[tuple[str, Layout], list[LatencySample]] = defaultdict(list)
    for s in fingerprints:
        if s.layout in layouts:
            latency[(s.variant, s.layout)].extend(s.latency_samples())
    latency = {key: value for key, value in latency.items() if value}
    ladder_direct = all(s.direct_phases for s in fingerprints if s.layout in ladder)
    # Variants whose phases come from end-to-end latencies alone (decode_steps).
    split = {v for v in keys if not any(s.direct_phases for s in fingerprints if s.variant == v)}
    kv_per_token = _kv_gib_per_token(fingerprints, shape.num_layers)
    ladder_phases = ("ttft", "tpot") if ladder_direct else ("ttft",)

    one, two = REFERENCE_BATCHES
    lengths = _prompts_of_every_variant(fingerprints, keys, batch=one)
    if not lengths:
        raise ValueError("no prompt length was profiled at tp=1 pp=1 batch 1 for every variant")
    prompt_lengths = sorted(n for n in lengths if n > 0) or [0]
    if prompt_lengths == [0]:
        notes.append(
            "the profiled prompt length was not recorded (rows of input_tokens 0, as in "
            "MaverIQ's short-prompt _BS files): every prompt is estimated as those runs "
            "measured, not scaled to its length; give the workload's prompt length for its KV cache"
        )
    batch_lengths = lengths & _prompts_of_every_variant(fingerprints, keys, batch=two)

    prompts = []
    for n in prompt_lengths:
        for layout in (TENSOR, PIPELINE):
            if (
                layout in runnable
                and layout in profiled
                and not _profiled_with(fingerprints, layout, n)
            ):
                notes.append(unprofiled_note(layout, n))
        if split:
            memory, kv_tokens, slopes = _memory_groups(fingerprints, layouts, n)
        else:
            # iserve's profiler runs a job's prompt lengths in one worker whose static
            # cache holds the longest prompt and output, shortest prompt first: each
            # prompt's rows hold that cache (the longest's rows say how many tokens) and
            # the activations of prompts up to its own, so memory follows the prompt's
            # length through the profiled ones and beyond (a layout not profiled at
            # this length keeps the longest's rows).
            memory, kv_tokens, slopes = _memory_groups(fingerprints, layouts, prompt_lengths[-1])
            memory = {**memory, **_memory_groups(fingerprints, layouts, n)[0]}
        refs = extrapolate_references(
            shape.num_layers, latency, memory, (n, 1), layouts, ladder_phases, slopes
        )
        refs = {v: _at_least_measured(refs[v], fingerprints, v, n) for v in keys}
        batch2 = {}
        m = n if n in batch_lengths else (max(batch_lengths) if batch_lengths else None)
        if m is not None:
            one = extrapolate_references(
                shape.num_layers, latency, memory, (m, 1), REFERENCE_LAYOUTS, memory_slopes=slopes
            )
            two = extrapolate_references(
                shape.num_layers, latency, memory, (m, 2), REFERENCE_LAYOUTS, memory_slopes=slopes
            )
            # 0: a prompt whose length the source did not record (MaverIQ's short ones).
            longer = m < n if m else n > 0
            batch2 = {v: _batch2(refs[v], one[v], two[v], longer) for v in keys}
        profiles = tuple(
            VariantProfile(refs[v], batch2.get(v), kv_tokens, v in split, kv_per_token.get(v, 0.0))
            for v in keys
        )
        prompts.append(PromptReferences(n, kv_tokens, profiles))
    if not batch_lengths:
        notes.append("batch 2 was not profiled for every variant: latency does not grow with batch")
    contended = contention_note(s.other_cpu_share for s in fingerprints)
    if contended:
        notes.append(contended)
    return ModelReferences(
        shape=shape,
        variants=tuple(variants[v] for v in keys),
        layouts=layouts,
        prompts=tuple(prompts),
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class Workload:
    """What a configuration is estimated for: prompt and output tokens, batch size.

    ``input_tokens`` 0 means the model's default profiled prompt length.
    """

    output_tokens: int
    input_tokens: int = 0
    batch_size: int = 1

    def __post_init__(self) -> None:
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be at least 1, got {self.output_tokens}")
        if self.input_tokens < 0 or self.batch_size < 1:
            raise ValueError("input_tokens must not be negative and batch_size must be at least 1")


def estimate(
    references: ModelReferences,
    calibration: Calibration,
    workload: Workload,
    devices: int,
    device_memory_gib: float | None = None,
) -> Estimates:
    """Every configuration of the model on ``devices`` devices for ``workload``.

    The KV cache is sized for ``batch_size`` sequences of prompt plus output tokens
    (the profiled KV cache swapped out, see ``score.estimate_space``).
    """
    input_tokens = workload.input_tokens or references.default_input_tokens(workload.output_tokens)
    space = enumerate_space(references.shape, devices, references.variants, (workload.batch_size,))
    return estimate_space(
        space,
        references.at_input(input_tokens),
        calibration,
        workload.output_tokens,
        max_seq_len=input_tokens + workload.output_tokens,
        device_memory_gib=device_memory_gib,
    )
