"""Ranking a model's configurations for an application developer's intent.

:func:`rank_for_intent` turns an ``Intent`` message into ``estimation.score.rank``'s
terms and back: the cost formula picks which cost ``MIN_COST``, ``LATENCY_SLO``
(cheapest under the SLO) and ``COST_SLO`` (budget) use, in the API's units (GB x s, GB,
device-hours); an accuracy floor nobody meets fails the call (FailedPrecondition),
unless ``allow_best_available_accuracy`` makes it the best accuracy available, which the
note says; an SLO nobody
meets falls back to minimum latency / cost with a note. Each ranked configuration says
whether it meets the intent itself or is only kept as a fallback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from services.api import common_pb2 as common
from services.errors import FailedPrecondition, InvalidArgument
from services.estimation.memory import GIB
from services.estimation.score import Estimates, Intent, rank

__all__ = ["RankedConfigs", "check_intent", "rank_for_intent"]

_KINDS = {
    common.INTENT_KIND_MIN_COST: "min_cost",
    common.INTENT_KIND_MIN_LATENCY: "min_latency",
    common.INTENT_KIND_MIN_MEMORY: "min_memory",
    common.INTENT_KIND_MIN_DEVICE_HOURS: "min_device_hours",
    common.INTENT_KIND_LATENCY_SLO: "latency_slo",
    common.INTENT_KIND_COST_SLO: "cost_slo",
    common.INTENT_KIND_MAX_THROUGHPUT: "max_throughput",
}
_COST_UNITS = {
    common.COST_FORMULA_MEMORY_TIMES_LATENCY: "GB*s",
    common.COST_FORMULA_MEMORY: "GB",
    common.COST_FORMULA_DEVICE_HOURS: "device-hours",
}


@dataclass(frozen=True)
class RankedConfigs:
    """Configuration indices, best first; per entry whether it meets the intent itself."""

    indices: np.ndarray
    meets_intent: np.ndarray
    notes: tuple[str, ...]

    @property
    def note(self) -> str:
        return "; ".join(self.notes)


def check_intent(intent: common.Intent) -> None:
    """InvalidArgument for an intent that cannot be ranked for."""
    if intent.kind not in _KINDS:
        raise InvalidArgument(
            "intent kind is unspecified or unknown; use one of "
            + ", ".join(common.IntentKind.Name(k) for k in _KINDS)
        )
    if intent.cost_formula not in (common.COST_FORMULA_UNSPECIFIED, *_COST_UNITS):
        raise InvalidArgument(f"unknown cost formula {intent.cost_formula}")
    if intent.kind == common.INTENT_KIND_LATENCY_SLO and not intent.latency_slo_ms > 0:
        raise InvalidArgument("a LATENCY_SLO intent needs a positive latency_slo_ms")
    if intent.kind == common.INTENT_KIND_COST_SLO and not intent.cost_budget > 0:
        raise InvalidArgument("a COST_SLO intent needs a positive cost_budget")
    if intent.HasField("min_accuracy") and not math.isfinite(intent.min_accuracy):
        raise InvalidArgument("min_accuracy must be a finite number")


def formula_cost(estimates: Estimates, cost_formula: int) -> np.ndarray:
    """Each configuration's cost under ``cost_formula``, in the API's unit."""
    if cost_formula == common.COST_FORMULA_MEMORY:
        return estimates.memory_total_gib * GIB / 1e9
    if cost_formula == common.COST_FORMULA_DEVICE_HOURS:
        return estimates.cost_device_hours
    return estimates.memory_total_gib * GIB / 1e9 * estimates.latency_s


def rank_for_intent(estimates: Estimates, intent: common.Intent) -> RankedConfigs:
    """Rank the configurations that fit their devices for ``intent`` (checked first)."""
    check_intent(intent)
    formula = intent.cost_formula or common.COST_FORMULA_MEMORY_TIMES_LATENCY
    cost = formula_cost(estimates, formula)
    # score.rank's cost is memory x latency; the intent's formula replaces it.
    scored = replace(estimates, cost_memory_latency=cost)
    kind = _KINDS[intent.kind]
    if kind == "min_cost":
        kind = {
            common.COST_FORMULA_MEMORY: "min_memory",
            common.COST_FORMULA_DEVICE_HOURS: "min_device_hours",
        }.get(formula, "min_cost")
    notes: list[str] = []
    floor = intent.min_accuracy if intent.HasField("min_accuracy") else None
    effective_floor = floor
    accuracy = estimates.accuracy_pct
    if floor is not None and not np.any(estimates.fits & (accuracy >= floor)):
        known = estimates.fits & np.isfinite(accuracy)
        best = f"{np.max(accuracy[known]):g}" if known.any() else "unknown"
        if not (intent.allow_best_available_accuracy and known.any()):
            raise FailedPrecondition(
                f"no variant that fits reaches the accuracy floor of {floor:g} "
                f"(best available: {best}); lower min_accuracy or allow the best available"
            )
        effective_floor = float(np.max(accuracy[known]))
        notes.append(
            f"no configuration reaches the accuracy floor of {floor:g}; "
            f"ranking the most accurate available ({effective_floor:g})"
        )
    ranking = rank(
        scored,
        Intent(
            kind=kind,
            latency_slo_s=intent.latency_slo_ms / 1e3 if kind == "latency_slo" else None,
            cost_budget=intent.cost_budget if kind == "cost_slo" else None,
            accuracy_floor_pct=effective_floor,
        ),
    )
    unit = _COST_UNITS[formula]
    notes.extend(note.replace(" GiB*s", f" {unit}") for note in ranking.notes)
    chosen = ranking.indices
    meets = np.ones(chosen.size, dtype=bool)
    if floor is not None:
        meets &= accuracy[chosen] >= floor
    if kind == "latency_slo":
        meets &= estimates.latency_s[chosen] <= intent.latency_slo_ms / 1e3
    if kind == "cost_slo":
        meets &= cost[chosen] <= intent.cost_budget
    return RankedConfigs(chosen, meets, tuple(notes))
