"""What an intent may say, and what happens to an accuracy floor nobody meets: the rules
the estimator and the deployer share.

:func:`check_intent` is the one validation of an ``Intent`` message; each service runs it
once where the message enters (the deployer before it asks for a ranking, the estimator's
servicer for RankConfigs). :func:`resolve_accuracy_floor` is the one fallback for a floor:
kept when a configuration that fits meets it; otherwise refused (FailedPrecondition) or,
when the intent allows the best available accuracy, lowered to the best accuracy a
fitting configuration has, with a note. ``services.estimation.score.rank`` then applies
the floor it is given as it is.
"""

from __future__ import annotations

import math

import numpy as np

from services.api import common_pb2 as common
from services.errors import FailedPrecondition, InvalidArgument
from services.proto_limits import UINT32_MAX

__all__ = [
    "COST_UNITS",
    "INTENT_KINDS",
    "MAX_LATENCY_SLO_MS",
    "MIN_LATENCY_SLO_MS",
    "check_intent",
    "resolve_accuracy_floor",
    "with_default",
]

# Intent kinds and the names estimation.score ranks them by.
INTENT_KINDS = {
    common.INTENT_KIND_MIN_COST: "min_cost",
    common.INTENT_KIND_MIN_LATENCY: "min_latency",
    common.INTENT_KIND_MIN_MEMORY: "min_memory",
    common.INTENT_KIND_MIN_DEVICE_HOURS: "min_device_hours",
    common.INTENT_KIND_LATENCY_SLO: "latency_slo",
    common.INTENT_KIND_COST_SLO: "cost_slo",
    common.INTENT_KIND_MAX_THROUGHPUT: "max_throughput",
}
# A LATENCY_SLO intent's latency becomes its deployment's default request deadline, a
# uint32 of milliseconds (about 49 days).
MAX_LATENCY_SLO_MS = UINT32_MAX
# The shortest: a microsecond. Below about 1e-305 ms the SLO in seconds is 0.0, which
# estimation.score refuses (it surfaced as INTERNAL; a probe sent 5e-324).
MIN_LATENCY_SLO_MS = 1e-3
# Cost formulas and the unit their costs are reported in.
COST_UNITS = {
    common.COST_FORMULA_MEMORY_TIMES_LATENCY: "GB*s",
    common.COST_FORMULA_MEMORY: "GB",
    common.COST_FORMULA_DEVICE_HOURS: "device-hours",
}
# The ConfigEstimate field that holds each formula's cost.
COST_FIELDS = {
    common.COST_FORMULA_MEMORY_TIMES_LATENCY: "cost_memory_latency",
    common.COST_FORMULA_MEMORY: "cost_memory",
    common.COST_FORMULA_DEVICE_HOURS: "cost_device_hours",
}


def with_default(intent: common.Intent) -> common.Intent:
    """A copy of ``intent`` whose unspecified kind is the default, MIN_COST."""
    filled = common.Intent()
    filled.CopyFrom(intent)
    filled.kind = filled.kind or common.INTENT_KIND_MIN_COST
    return filled


def check_intent(intent: common.Intent) -> None:
    """InvalidArgument for an intent that cannot be ranked for."""
    if intent.kind not in INTENT_KINDS:
        raise InvalidArgument(
            "intent kind is unspecified or unknown; use one of "
            + ", ".join(common.IntentKind.Name(k) for k in INTENT_KINDS)
        )
    if intent.cost_formula not in (common.COST_FORMULA_UNSPECIFIED, *COST_UNITS):
        raise InvalidArgument(f"unknown cost formula {intent.cost_formula}")
    if intent.kind == common.INTENT_KIND_LATENCY_SLO and not intent.latency_slo_ms > 0:
        raise InvalidArgument("a LATENCY_SLO intent needs a positive latency_slo_ms")
    if intent.kind == common.INTENT_KIND_LATENCY_SLO and intent.latency_slo_ms < MIN_LATENCY_SLO_MS:
        raise InvalidArgument(
            f"latency_slo_ms must be at least {MIN_LATENCY_SLO_MS:g} (a microsecond), got "
            f"{intent.latency_slo_ms!r}"
        )
    if not intent.latency_slo_ms <= MAX_LATENCY_SLO_MS:  # NaN and infinity included
        raise InvalidArgument(
            f"latency_slo_ms must be at most {MAX_LATENCY_SLO_MS} (the longest deadline a "
            f"request can carry), got {intent.latency_slo_ms}"
        )
    if intent.kind == common.INTENT_KIND_COST_SLO and not intent.cost_budget > 0:
        raise InvalidArgument("a COST_SLO intent needs a positive cost_budget")
    if not math.isfinite(intent.cost_budget):
        raise InvalidArgument(f"cost_budget must be a finite number, got {intent.cost_budget}")
    if intent.HasField("min_accuracy") and not 0 <= intent.min_accuracy < math.inf:
        raise InvalidArgument(
            f"min_accuracy must be a finite number, 0 or more (an accuracy score), got "
            f"{intent.min_accuracy}"
        )


def resolve_accuracy_floor(
    floor: float | None,
    accuracy: np.ndarray,
    fits: np.ndarray,
    *,
    allow_best_available: bool,
) -> tuple[float | None, str]:
    """(the floor to rank with, a note saying what was given up or "") for configurations
    with ``accuracy`` (NaN: unknown) of which ``fits`` fit their devices.

    FailedPrecondition when no fitting configuration reaches ``floor`` and the best
    available is not allowed (or no fitting configuration's accuracy is known)."""
    if floor is None or np.any(fits & (accuracy >= floor)):
        return floor, ""
    known = fits & np.isfinite(accuracy)
    best = float(np.max(accuracy[known])) if known.any() else None
    if best is None:
        raise FailedPrecondition(
            f"an accuracy floor of {floor:g} cannot be checked: no variant that fits has a "
            "known accuracy score (register the model with --accuracy, or import the "
            "variants' scores)"
        )
    if not allow_best_available:
        raise FailedPrecondition(
            f"no variant that fits reaches the accuracy floor of {floor:g} "
            f"(best available: {best:g}); "
            "lower min_accuracy or allow the best available "
            "(Intent.allow_best_available_accuracy; the CLI's --best-available)"
        )
    return best, (
        f"no configuration reaches the accuracy floor of {floor:g}; "
        f"ranking the most accurate available ({best:g})"
    )
