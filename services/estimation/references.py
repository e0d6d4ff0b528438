"""From raw fingerprint measurements to the full model's reference figures.

Profiling runs each fingerprint under the reference layouts (1,1), (2,1) and (1,2) (tp,
pp), and optionally along a TP ladder (4,1), (8,1). This module extrapolates what the
full model would show in each: TTFT, TPOT and memory summed over devices. Those numbers
per variant are all that scoring needs (with Eq. 2 for latency and the memory model for
footprints).

How iserve extrapolates, and why it differs from the papers where it does:

* Latency: one least-squares fit per model over all its variants and layouts
  (:func:`~services.estimation.extrapolate.fit_pooled_latency`). A variant's per-layer
  TTFT and TPOT come from its pp = 1 fingerprints; TP communication per layer and the
  "other" terms are shared by the variants; pp > 1 fingerprints only fit their "other"
  terms (a stage boundary does not grow with the layers). The papers solve each layout
  from its own four points, which multiplies the timing noise of two tiny differences
  by the layer count: on the A6000 data that is a 20-60 % median error on the (2,1) and
  (1,2) references, 3-9 % here.
* Memory: one per-layer slope per variant shared by its layouts (a layer costs the same
  summed over devices however it is split), taken from the (1,1) fingerprints (one rank,
  the figure measured most exactly), and an intercept per layout.
* A reference with no fingerprints (a model whose heads forbid tp = 2) gets values that
  make its overhead zero; such a model has no configuration that would use it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.estimation.extrapolate import (
    LatencySample,
    fit_layer_memory_shared,
    fit_pooled_latency,
)
from services.estimation.latency import BASE, PIPELINE, REFERENCE_LAYOUTS, TENSOR

__all__ = [
    "BASE",
    "PIPELINE",
    "REFERENCE_LAYOUTS",
    "TENSOR",
    "ReferenceProfile",
    "VariantProfile",
    "extrapolate_references",
    "stack_profiles",
]


@dataclass(frozen=True)
class ReferenceProfile:
    """Full-model figures of one variant at its profiled layouts, batch size 1.

    ``layouts`` starts with (1,1), (2,1), (1,2) (the references of Eq. 2); profiled
    layouts beyond those (say (4,1) and (8,1)) follow. TTFT and TPOT in seconds (TTFT
    for the prompt the profile was extrapolated for), memory in GiB summed over the
    layout's devices.
    """

    layouts: tuple[tuple[int, int], ...]
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]
    memory_gib: tuple[float, ...]

    def at(self, layout: tuple[int, int]) -> tuple[float, float, float]:
        """(TTFT s, TPOT s, memory GiB) of one profiled layout."""
        i = self.layouts.index(layout)
        return self.ttft_s[i], self.tpot_s[i], self.memory_gib[i]

    def latency_s(self, output_tokens: float) -> tuple[float, ...]:
        """End-to-end latency of each layout for ``output_tokens`` tokens, for references
        split out of end-to-end latencies (``L = TTFT + N * TPOT``)."""
        return tuple(f + output_tokens * p for f, p in zip(self.ttft_s, self.tpot_s, strict=True))


@dataclass(frozen=True)
class VariantProfile:
    """Everything scoring needs to know of one variant from its profile.

    ``batch1`` holds the references at batch size 1; ``batch2`` (same layouts), when
    profiled, gives the per-sequence overheads of MaverIQ's batch model.
    ``kv_tokens_profiled`` is how many tokens of KV cache the profiled memory already
    holds (prompt plus output of the profiling requests, for an engine that allocates
    KV pages on demand; 0 for one that allocates nothing before the requests arrive),
    so that scoring can replace it with the deployment's own KV cache.
    ``end_to_end_split`` says the TTFT and TPOT references were split out of end-to-end
    latencies (``L = TTFT + N * TPOT``, measurements without token timestamps) rather
    than timed from token streams (``L = TTFT + (N - 1) * TPOT``): see
    :func:`services.estimation.latency.decode_steps`. ``kv_gib_per_token`` is what one
    token's K and V take in every layer (unsharded, GiB) as the profiled engine stored
    them, in the dtype it computed in (0: unknown; scoring then takes the architecture's
    16-bit figure).
    """

    batch1: ReferenceProfile
    batch2: ReferenceProfile | None = None
    kv_tokens_profiled: int = 0
    end_to_end_split: bool = False
    kv_gib_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.batch2 is not None and self.batch2.layouts != self.batch1.layouts:
            raise ValueError("batch-2 references must have the batch-1 layouts")
        if self.kv_tokens_profiled < 0:
            raise ValueError("kv_tokens_profiled must not be negative")
        if not self.kv_gib_per_token >= 0:
            raise ValueError("kv_gib_per_token must not be negative")


def _layouts_of(keys: Sequence[tuple[Hashable, tuple[int, int]]]) -> tuple[tuple[int, int], ...]:
    profiled = {layout for _, layout in keys}
    extra = sorted(profiled - set(REFERENCE_LAYOUTS))
    return REFERENCE_LAYOUTS + tuple(extra)


def extrapolate_references(
    num_layers: int,
    latency: Mapping[tuple[Hashable, tuple[int, int]], Sequence[LatencySample]],
    memory: Mapping[tuple[Hashable, tuple[int, int]], tuple[Sequence[float], Sequence[float]]],
    prompt: Hashable = "default",
    layouts: Sequence[tuple[int, int]] | None = None,
    tp_ladder_phases: tuple[str, ...] = ("ttft", "tpot"),
    memory_slopes: Mapping[Hashable, float] | None = None,
) -> dict[Hashable, ReferenceProfile]:
    """Extrapolate every variant of one model from its fingerprint samples.

    ``latency`` maps (variant, (tp, pp)) to samples; ``memory`` maps the same keys to
    (layer counts, GiB summed over devices). Each variant needs its (1,1) samples;
    (2,1) and (1,2) may be missing when the model cannot use them, or lack samples with
    ``prompt`` (then they are filled so that Eq. 2 charges no overhead for them); a TP-ladder layout a variant lacks is
    NaN, which Eq. 2 replaces by its extrapolation. ``prompt`` picks the TTFT terms when
    samples were taken with several prompts. ``layouts`` fixes the layouts of every
    profile (the references first, then TP-ladder layouts); by default they are the
    references plus whatever was profiled. ``tp_ladder_phases`` names the phases whose
    TP-ladder figures are trusted; the others are left NaN so that Eq. 2 extrapolates
    them. (TPOT from end-to-end timings at 10 and 20 output tokens of a one-layer
    fingerprint at tp = 8 is below the timing noise on the A6000 data, to the point of
    coming out negative; TPOT from token timestamps need not be.) ``memory_slopes`` maps
    a variant to its per-layer GiB when known a priori (weights and KV cache from the
    architecture and the engine's formats); its samples then fit only the intercepts.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    variants = list(dict.fromkeys(v for v, _ in latency))
    for v in variants:
        if (v, BASE) not in latency or (v, BASE) not in memory:
            raise ValueError(f"variant {v!r}: samples of the (1,1) reference are required")
    if layouts is None:
        layouts = _layouts_of(list(latency))
    layouts = tuple(layouts)
    if layouts[:3] != REFERENCE_LAYOUTS:
        raise ValueError(f"layouts must start with {REFERENCE_LAYOUTS}, got {layouts}")
    fit = fit_pooled_latency(latency)
    profiles = {}
    for v in variants:
        lines = fit_layer_memory_shared(
            {layout: memory[(v, layout)] for layout in layouts if (v, layout) in memory},
            slope_from=BASE,
            known_slope=(memory_slopes or {}).get(v),
        )
        ttft, tpot, mem = [], [], []
        for layout in layouts:
            terms = None
            if (v, layout) in latency:
                try:
                    terms = fit.layer_latency(v, layout, prompt)
                except KeyError:
                    if layout == BASE:
                        raise
                    # Profiled at this layout, but with other prompts only (a model's
                    # short-prompt rows at (2,1), its long-prompt ones at (1,1) alone):
                    # the layout is estimated as one never profiled.
            if terms is not None:
                ladder = layout not in REFERENCE_LAYOUTS
                nan = float("nan")
                ttft.append(
                    nan if ladder and "ttft" not in tp_ladder_phases else terms.ttft(num_layers)
                )
                tpot.append(
                    nan if ladder and "tpot" not in tp_ladder_phases else terms.tpot(num_layers)
                )
            elif layout == TENSOR:
                # O_TP = L(2,1) - L(1,1)/2 = 0: no tensor-parallel configuration exists anyway.
                ttft.append(ttft[0] / 2.0)
                tpot.append(tpot[0] / 2.0)
            elif layout == PIPELINE:
                ttft.append(ttft[0])
                tpot.append(tpot[0])
            else:
                # A TP-ladder layout this variant was not profiled at: Eq. 2 extrapolates.
                ttft.append(float("nan"))
                tpot.append(float("nan"))
            if layout in lines:
                mem.append(lines[layout].at(num_layers))
            elif layout in REFERENCE_LAYOUTS:
                mem.append(lines[BASE].at(num_layers))
            else:
                mem.append(float("nan"))
        profiles[v] = ReferenceProfile(layouts, tuple(ttft), tuple(tpot), tuple(mem))
    return profiles


def stack_profiles(profiles: Sequence[ReferenceProfile]) -> dict[str, np.ndarray]:
    """Arrays of shape (len(profiles), layouts) for vectorised scoring: ttft, tpot, memory.

    All profiles must share their layouts.
    """
    layouts = {p.layouts for p in profiles}
    if len(layouts) > 1:
        raise ValueError(f"profiles have different layouts: {sorted(layouts)}")
    return {
        "ttft": np.array([p.ttft_s for p in profiles], dtype=float),
        "tpot": np.array([p.tpot_s for p in profiles], dtype=float),
        "memory": np.array([p.memory_gib for p in profiles], dtype=float),
    }
