"""Score every configuration of a model at once, and rank them for an intent.

:func:`estimate_space` turns a :class:`~services.estimation.space.ConfigSpace`, one
:class:`~services.estimation.references.VariantProfile` per variant and the hardware
:class:`Calibration` into an :class:`Estimates` of numpy arrays, one entry per
configuration. It never loops over configurations: each step is array arithmetic over
the whole space (about 1 µs per configuration for thousands of them).

:func:`rank` orders the configurations for an :class:`Intent` and says in plain words
what it had to give up (a floor nobody meets, an SLO nobody meets, configurations that
do not fit the devices). Both are pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.estimation.latency import (
    O_PP_FROM_PP2,
    PhaseConstants,
    ReferenceScales,
    decode_steps,
    phase_latency,
)
from services.estimation.memory import (
    MemoryComponents,
    MemoryConstants,
    kv_cache_gib,
    kv_replication,
    per_device_memory_gib,
    solve_memory_components,
    total_memory_gib,
)
from services.estimation.references import VariantProfile, stack_profiles
from services.estimation.space import ConfigSpace

__all__ = [
    "INTENTS",
    "Calibration",
    "Estimates",
    "Intent",
    "Ranking",
    "estimate_space",
    "rank",
]


# The note of the configurations left out for the devices' memory (the deployer's
# refusal finds it in the ranking's notes: deploy_svc.planning.decide).
UNFIT_NOTE = "configurations do not fit the device memory"
_UNFIT_NOTE_ONE = "configuration does not fit the device memory"


def unfit_note(count: int) -> str:
    """``count`` configurations left out for the devices' memory, in words ("1
    configurations do not fit" read as a slip)."""
    return f"{count} {_UNFIT_NOTE_ONE if count == 1 else UNFIT_NOTE}"


def is_unfit_note(part: str) -> bool:
    """Whether one "; "-separated part of a ranking's note is :func:`unfit_note`'s."""
    return part.endswith((UNFIT_NOTE, _UNFIT_NOTE_ONE))


@dataclass(frozen=True)
class Calibration:
    """The hardware constants scoring needs (see ``calibrate``)."""

    latency: PhaseConstants
    memory: MemoryConstants = MemoryConstants()
    reference_scales: ReferenceScales = ReferenceScales()
    o_pp_from: str = O_PP_FROM_PP2
    # (weight format, tp, r): each further sequence of a batch adds at least r x the
    # batch-1 TPOT, as the hardware's full-model batch sweeps measured it
    # (calibrate.fit_tpot_batch_growth); none measured: the batch-2 profiles alone.
    tpot_batch_growth: tuple[tuple[str, int, float], ...] = ()

    def batch_growth(self, weights: np.ndarray, tp: np.ndarray) -> np.ndarray:
        """``r`` of each (weight format, tp) pair; a pre-quantized format unmeasured
        takes its bit width's (``int4_gptq``: ``int4``'s: the same weight-only int4
        decode; left at 0, a GPTQ batch of 256 decoded as fast as one and was ranked
        first: a tester); 0 where neither was measured."""
        table = {(w, t): r for w, t, r in self.tpot_batch_growth}

        def rate(weight: str, degree: int) -> float:
            found = table.get((weight, degree))
            return table.get((weight.split("_")[0], degree), 0.0) if found is None else found

        return np.array([rate(w, int(t)) for w, t in zip(weights, tp, strict=True)], dtype=float)


@dataclass(frozen=True)
class Estimates:
    """Per-configuration estimates, aligned with ``space.configs``.

    Memory in GiB, times in seconds; ``cost_memory_latency`` in GiB * s (the papers'
    default cost) and ``cost_device_hours`` in device-hours, both per request: a batch
    of B sequences holds the memory and the devices for its latency and serves B
    requests, so each is charged 1/B of them (as ``throughput`` counts B sequences'
    tokens; at batch 1 the papers' figures). ``cost_memory_gib`` is the deployment's
    memory, all of it (a min-memory intent's footprint). ``throughput`` in generated
    tokens per second per device, ``accuracy_pct`` NaN where unknown.
    """

    space: ConfigSpace
    output_tokens: int
    memory_total_gib: np.ndarray
    memory_per_device_gib: np.ndarray
    # The KV cache within memory_total_gib (all devices): batch x max_seq_len tokens.
    kv_cache_gib: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    latency_s: np.ndarray
    cost_memory_latency: np.ndarray
    cost_memory_gib: np.ndarray
    cost_device_hours: np.ndarray
    throughput_tokens_per_s_per_device: np.ndarray
    accuracy_pct: np.ndarray
    fits: np.ndarray
    # Whether batches above 1 are charged from batch-2 profiles (Eq. 6); False: no
    # profile was taken at batch 2, and a batch is estimated as free in time.
    batch_measured: bool = False
    # What each device reserves as the deployer sizes it (an even split's largest stage,
    # at least memory_per_device_gib; NaN where not known), when ``fits`` was judged by
    # it (estimator_svc.service.reserved_fits); None: judged by the estimate alone.
    reserved_per_device_gib: np.ndarray | None = None

    @property
    def estimable(self) -> np.ndarray:
        """Configurations whose TTFT, TPOT and memory came out finite and positive.
        Fingerprints too noisy or too few for a layout can extrapolate to a negative or
        undefined figure there; such a configuration is never ranked."""
        figures = (self.ttft_s, self.tpot_s, self.latency_s, self.memory_total_gib)
        return np.logical_and.reduce([np.isfinite(f) & (f > 0) for f in figures])

    @property
    def candidates(self) -> np.ndarray:
        """Configurations that may be ranked: they fit and have a usable estimate."""
        return self.fits & self.estimable

    def unestimable_note(self) -> str | None:
        """What was left out for want of a usable estimate, or None."""
        count = int(self.space.size - np.count_nonzero(self.estimable))
        if not count:
            return None
        return (
            f"{count} configurations left out: their fingerprints extrapolate to a negative "
            "or undefined latency or memory (too few or too noisy profiling runs for those "
            "layouts; profile again, or check imported rows)"
        )


def _per_variant_arrays(
    profiles: Sequence[VariantProfile],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    first = stack_profiles([p.batch1 for p in profiles])
    if all(p.batch2 is not None for p in profiles):
        return first, stack_profiles([p.batch2 for p in profiles])  # type: ignore[misc]
    return first, None


def estimate_space(
    space: ConfigSpace,
    profiles: Sequence[VariantProfile],
    calibration: Calibration,
    output_tokens: int,
    max_seq_len: int | None = None,
    device_memory_gib: float | None = None,
) -> Estimates:
    """Estimate every configuration of ``space`` for requests of ``output_tokens`` tokens.

    ``profiles[i]`` belongs to ``space.variants[i]``. ``max_seq_len`` (prompt plus
    output, tokens) sizes the KV cache each sequence of a batch reserves; without it
    each sequence of a batch is charged the KV cache the profiling request held. ``device_memory_gib`` marks which configurations
    fit (per-device footprint at most that); without it every configuration fits.
    """
    if len(profiles) != len(space.variants):
        raise ValueError(f"{len(profiles)} profiles for {len(space.variants)} variants")
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be at least 1, got {output_tokens}")
    layouts = profiles[0].batch1.layouts
    refs1, refs2 = _per_variant_arrays(profiles)
    v = space.variant
    tp = space.tp.astype(float)
    pp = space.pp.astype(float)
    batch = space.batch.astype(float)
    c = calibration
    weights = np.array([variant.weight_quant for variant in space.variants], dtype=object)
    split = np.array([p.end_to_end_split for p in profiles], dtype=bool)[v]

    def phases(refs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        ttft_refs, tpot_refs = c.reference_scales.apply(refs["ttft"], refs["tpot"], weights)
        ttft, tpot, _ = phase_latency(
            ttft_refs[v], tpot_refs[v], tp, pp, 0.0, c.latency, c.o_pp_from, layouts
        )
        return ttft, tpot

    ttft, tpot = phases(refs1)
    # Decode's growth per further sequence as the hardware's batch sweeps measured it:
    # the floor of the batch-2 profiles' own, which time it within their noise.
    tpot_growth = c.batch_growth(weights[v], space.tp) * tpot
    if refs2 is not None:
        ttft2, tpot2 = phases(refs2)
        # MaverIQ Eq. 6 per phase; a batch never makes a request faster.
        ttft = ttft + (batch - 1.0) * np.maximum(ttft2 - ttft, 0.0)
        tpot = tpot + (batch - 1.0) * np.maximum(tpot2 - tpot, tpot_growth)
    else:
        tpot = tpot + (batch - 1.0) * tpot_growth
    # A TTFT split out of end-to-end latencies leaves the first token's step in the TPOTs
    # (decode_steps); every estimate's TTFT is the first token's arrival, as streamed.
    latency = ttft + decode_steps(output_tokens, split) * tpot
    ttft = ttft + np.where(split, tpot, 0.0)

    mem_refs = refs1["memory"][:, :3]
    parts = solve_memory_components(mem_refs[:, 0], mem_refs[:, 1], mem_refs[:, 2], c.memory)
    weights = np.asarray(parts.weights_gib)[v]
    activations = np.asarray(parts.activations_gib)[v]
    pipeline = np.asarray(parts.pipeline_activations_gib)[v]
    memory = total_memory_gib(MemoryComponents(weights, activations, pipeline), tp, pp, c.memory)
    # One token's K and V as the profiled engine stored them (its dtype: float32 on a
    # CPU), else the architecture's 16-bit figure; tp ranks may hold copies of heads.
    known = np.array([p.kv_gib_per_token for p in profiles], dtype=float)
    architecture = np.array(
        [float(kv_cache_gib(space.shape, 1, 1, variant.kv_quant)) for variant in space.variants]
    )
    kv_per_token = np.where(known > 0, known, architecture)[v] * kv_replication(
        space.shape.num_kv_heads, tp
    )
    profiled_tokens = np.array([p.kv_tokens_profiled for p in profiles], dtype=float)[v]
    if max_seq_len is not None:
        # Swap the profiled KV cache for the deployment's: batch x max_seq_len tokens.
        kv_cache = kv_per_token * batch * max_seq_len
        memory = memory + kv_cache - kv_per_token * profiled_tokens
    else:
        # Each further sequence holds what the profiled one did (Eq. 6 with O_BS_M from
        # the architecture: fingerprints' batch-2 memory grows by a few MiB, below what
        # NVML resolves well enough to extrapolate).
        kv_cache = kv_per_token * batch * profiled_tokens
        memory = memory + kv_per_token * (batch - 1.0) * profiled_tokens

    devices = space.device_count.astype(float)
    per_device = per_device_memory_gib(memory, space.tp, space.pp)
    accuracy = np.array(
        [np.nan if var.accuracy_pct is None else var.accuracy_pct for var in space.variants]
    )[v]
    fits = (
        np.ones(space.size, dtype=bool)
        if device_memory_gib is None
        else per_device <= device_memory_gib
    )
    return Estimates(
        space=space,
        output_tokens=output_tokens,
        memory_total_gib=memory,
        memory_per_device_gib=per_device,
        kv_cache_gib=kv_cache,
        ttft_s=ttft,
        tpot_s=tpot,
        latency_s=latency,
        cost_memory_latency=memory * latency / batch,
        cost_memory_gib=memory,
        cost_device_hours=devices * latency / 3600.0 / batch,
        throughput_tokens_per_s_per_device=batch * output_tokens / latency / devices,
        accuracy_pct=accuracy,
        fits=fits,
        batch_measured=refs2 is not None,
    )


INTENTS = (
    "min_cost",
    "min_latency",
    "min_memory",
    "min_device_hours",
    "latency_slo",
    "cost_slo",
    "max_throughput",
)


@dataclass(frozen=True)
class Intent:
    """What the application developer asked for.

    ``kind`` is one of :data:`INTENTS`. ``latency_slo_s`` goes with ``latency_slo``
    (keep configurations at most that slow, cheapest first), ``cost_budget`` with
    ``cost_slo`` (keep those at most that memory x latency, fastest first).
    ``accuracy_floor_pct`` (% of FP16) applies to every kind.
    """

    kind: str = "min_cost"
    latency_slo_s: float | None = None
    cost_budget: float | None = None
    accuracy_floor_pct: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in INTENTS:
            raise ValueError(f"unknown intent {self.kind!r}; known: {list(INTENTS)}")
        if self.kind == "latency_slo" and (self.latency_slo_s is None or self.latency_slo_s <= 0):
            raise ValueError("a latency_slo intent needs a positive latency_slo_s")
        if self.kind == "cost_slo" and (self.cost_budget is None or self.cost_budget <= 0):
            raise ValueError("a cost_slo intent needs a positive cost_budget")


@dataclass(frozen=True)
class Ranking:
    """Configuration indices, best first, and what the ranking had to give up."""

    indices: np.ndarray
    notes: tuple[str, ...]

    @property
    def best(self) -> int | None:
        """Index of the best configuration, None when nothing fits."""
        return int(self.indices[0]) if self.indices.size else None


def _order(candidates: np.ndarray, key: np.ndarray, devices: np.ndarray) -> np.ndarray:
    # Ties go to fewer devices, then to the lower index: a deterministic order.
    sub = candidates[np.lexsort((candidates, devices[candidates], key[candidates]))]
    return sub


def _nothing_fits(e: Estimates) -> str:
    """Why nothing fits: the least memory per device any configuration needs, and its
    layout (the engine splits a model at most tp x pp ways, however many devices)."""
    estimable = np.flatnonzero(e.estimable)
    reserved = e.reserved_per_device_gib is not None
    per_device = e.reserved_per_device_gib if reserved else e.memory_per_device_gib
    least = estimable[np.argmin(per_device[estimable])]
    space = e.space
    gib = float(per_device[least])
    # A small model's need in MiB: "0.0 GiB" said nothing.
    need = f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"
    variant = space.variants[space.variant[least]].name or "the checkpoint as stored"
    count = int(space.device_count[least])
    how = " as the deployer reserves it" if reserved else ""
    return (
        f"no configuration fits the device memory: the least any needs is {need} per "
        f"device{how} ({variant} at tp={space.tp[least]} pp={space.pp[least]}, "
        f"{count} device{'' if count == 1 else 's'})"
    )


def rank(estimates: Estimates, intent: Intent, cost: np.ndarray | None = None) -> Ranking:
    """Order the configurations that fit for ``intent``; see :class:`Intent`.

    ``cost`` is what ``min_cost`` and ``cost_slo`` rank by (default: memory × latency,
    ``estimates.cost_memory_latency``). An accuracy floor is applied as given: only
    configurations that reach it are ranked (what to do with a floor nobody reaches is
    ``services.intents.resolve_accuracy_floor``'s decision, taken before). A latency SLO
    nobody meets falls back to minimum latency, a cost budget nobody meets to minimum
    cost; both say so in the notes.
    """
    e = estimates
    cost = e.cost_memory_latency if cost is None else cost
    notes: list[str] = []
    devices = e.space.device_count
    unestimable = e.unestimable_note()
    if unestimable:
        notes.append(unestimable)
    candidates = np.flatnonzero(e.candidates)
    misfits = int(np.count_nonzero(e.estimable & ~e.fits))
    if misfits:
        notes.append(unfit_note(misfits))
    if candidates.size == 0:
        notes.append(_nothing_fits(e) if misfits else "no configuration has a usable estimate")
        return Ranking(candidates, tuple(notes))

    if intent.accuracy_floor_pct is not None:
        candidates = candidates[e.accuracy_pct[candidates] >= intent.accuracy_floor_pct]
        if candidates.size == 0:
            notes.append(
                f"no configuration that fits reaches the accuracy floor of "
                f"{intent.accuracy_floor_pct:g} %"
            )
            return Ranking(candidates, tuple(notes))

    kind = intent.kind
    if kind == "latency_slo":
        meeting = candidates[e.latency_s[candidates] <= intent.latency_slo_s]
        if meeting.size:
            return Ranking(_order(meeting, cost, devices), tuple(notes))
        notes.append(
            f"no configuration meets the latency SLO of {intent.latency_slo_s:g} s; "
            "falling back to minimum latency"
        )
        kind = "min_latency"
    if kind == "cost_slo":
        meeting = candidates[cost[candidates] <= intent.cost_budget]
        if meeting.size:
            return Ranking(_order(meeting, e.latency_s, devices), tuple(notes))
        notes.append(
            f"no configuration meets the cost budget of {intent.cost_budget:g} GB*s at "
            "this batch; falling back to minimum cost (a deployer that sizes the batch "
            "looks for one that meets it)"
        )
        kind = "min_cost"
    key = {
        "min_cost": cost,
        "min_latency": e.latency_s,
        "min_memory": e.cost_memory_gib,
        "min_device_hours": e.cost_device_hours,
        "max_throughput": -e.throughput_tokens_per_s_per_device,
    }[kind]
    return Ranking(_order(candidates, key, devices), tuple(notes))
