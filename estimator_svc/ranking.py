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

from dataclasses import dataclass

import numpy as np

from services.api import common_pb2 as common
from services.estimation.memory import GIB
from services.estimation.score import Estimates, Intent, rank
from services.intents import COST_UNITS, INTENT_KINDS, resolve_accuracy_floor

__all__ = ["RankedConfigs", "formula_cost", "rank_for_intent"]


@dataclass(frozen=True)
class RankedConfigs:
    """Configuration indices, best first; per entry whether it meets the intent itself
    and, where it does not, what of the intent it misses (``shortfalls``)."""

    indices: np.ndarray
    meets_intent: np.ndarray
    notes: tuple[str, ...]
    shortfalls: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        return "; ".join(self.notes)


def formula_cost(estimates: Estimates, cost_formula: int) -> np.ndarray:
    """Each configuration's cost under ``cost_formula``, in the API's unit."""
    if cost_formula == common.COST_FORMULA_MEMORY:
        return estimates.memory_total_gib * GIB / 1e9
    if cost_formula == common.COST_FORMULA_DEVICE_HOURS:
        return estimates.cost_device_hours
    return estimates.memory_total_gib * GIB / 1e9 * estimates.latency_s


def rank_for_intent(estimates: Estimates, intent: common.Intent) -> RankedConfigs:
    """Rank the configurations that fit their devices for ``intent`` (which
    ``services.intents.check_intent`` passed)."""
    formula = intent.cost_formula or common.COST_FORMULA_MEMORY_TIMES_LATENCY
    cost = formula_cost(estimates, formula)
    kind = INTENT_KINDS[intent.kind]
    if kind == "min_cost":
        kind = {
            common.COST_FORMULA_MEMORY: "min_memory",
            common.COST_FORMULA_DEVICE_HOURS: "min_device_hours",
        }.get(formula, "min_cost")
    floor = intent.min_accuracy if intent.HasField("min_accuracy") else None
    accuracy = estimates.accuracy_pct
    effective_floor, floor_note = resolve_accuracy_floor(
        floor,
        accuracy,
        estimates.candidates,
        allow_best_available=intent.allow_best_available_accuracy,
    )
    notes = [floor_note] if floor_note else []
    ranking = rank(
        estimates,
        Intent(
            kind=kind,
            latency_slo_s=intent.latency_slo_ms / 1e3 if kind == "latency_slo" else None,
            cost_budget=intent.cost_budget if kind == "cost_slo" else None,
            accuracy_floor_pct=effective_floor,
        ),
        cost,
    )
    unit = COST_UNITS[formula]
    notes.extend(note.replace(" GB*s", f" {unit}") for note in ranking.notes)
    chosen = ranking.indices
    # Which part each misses, as arrays over the ranking (it may hold thousands); the
    # words are written for the fallbacks alone.
    under_floor = ~(accuracy[chosen] >= floor) if floor is not None else np.zeros(chosen.size, bool)
    slo_s = intent.latency_slo_ms / 1e3
    too_slow = estimates.latency_s[chosen] > slo_s if kind == "latency_slo" else None
    too_dear = cost[chosen] > intent.cost_budget if kind == "cost_slo" else None
    meets = ~under_floor
    for missed in (too_slow, too_dear):
        if missed is not None:
            meets &= ~missed
    shortfalls = [""] * chosen.size
    for place in np.flatnonzero(~meets):
        index, parts = chosen[place], []
        if under_floor[place]:
            parts.append(
                f"its accuracy {accuracy[index]:g} is under the floor of {floor:g}"
                if np.isfinite(accuracy[index])
                else f"its accuracy is unknown, the floor is {floor:g}"
            )
        if too_slow is not None and too_slow[place]:
            # In seconds, as the ranking's note says the SLO (a tester read both).
            parts.append(
                f"its estimated latency {estimates.latency_s[index]:.3g} s is over the "
                f"{slo_s:g} s SLO"
            )
        if too_dear is not None and too_dear[place]:
            parts.append(
                f"its estimated cost {cost[index]:.4g} {unit} is over the budget of "
                f"{intent.cost_budget:g} {unit}"
            )
        shortfalls[place] = " and ".join(parts)
    return RankedConfigs(chosen, meets, tuple(notes), tuple(shortfalls))
