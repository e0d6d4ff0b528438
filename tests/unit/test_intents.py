"""services.intents: the intent checks and the one accuracy-floor fallback."""

from __future__ import annotations

import numpy as np
import pytest

from services.api import common_pb2 as common
from services.errors import FailedPrecondition, InvalidArgument
from services.intents import check_intent, resolve_accuracy_floor, with_default

ACCURACY = np.array([100.0, 95.0, np.nan, 99.0])
FITS = np.array([False, True, True, True])  # the most accurate does not fit


def test_an_unspecified_kind_defaults_to_min_cost_and_bad_intents_are_invalid():
    assert with_default(common.Intent()).kind == common.INTENT_KIND_MIN_COST
    check_intent(with_default(common.Intent()))
    with pytest.raises(InvalidArgument, match="positive latency_slo_ms"):
        check_intent(common.Intent(kind=common.INTENT_KIND_LATENCY_SLO))
    with pytest.raises(InvalidArgument, match="unspecified or unknown"):
        check_intent(common.Intent())
    # A floor is an accuracy score: 0 or more, finite.
    check_intent(common.Intent(kind=common.INTENT_KIND_MIN_COST, min_accuracy=0.0))
    for floor in (-5.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="min_accuracy must be a finite number, 0 or"):
            check_intent(common.Intent(kind=common.INTENT_KIND_MIN_COST, min_accuracy=floor))


@pytest.mark.parametrize(
    ("floor", "allow", "expected"),
    [
        (None, False, (None, "")),
        (97.0, False, (97.0, "")),  # 99 fits and reaches it
        (99.5, True, (99.0, "ranking the most accurate available (99)")),
    ],
)
def test_a_floor_is_kept_or_lowered_to_the_best_that_fits(floor, allow, expected):
    effective, note = resolve_accuracy_floor(floor, ACCURACY, FITS, allow_best_available=allow)
    assert effective == expected[0] and expected[1] in note


def test_a_floor_nobody_fitting_reaches_is_refused_unless_the_best_is_allowed():
    with pytest.raises(FailedPrecondition, match=r"floor of 99.5 \(best available: 99\)"):
        resolve_accuracy_floor(99.5, ACCURACY, FITS, allow_best_available=False)
    unknown = np.array([np.nan, np.nan])
    with pytest.raises(FailedPrecondition, match="floor of 90 cannot be checked.*--accuracy"):
        resolve_accuracy_floor(90.0, unknown, np.ones(2, bool), allow_best_available=True)
