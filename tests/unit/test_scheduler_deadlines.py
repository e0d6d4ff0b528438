"""First-token deadlines from a deployment's objectives and a request's own deadline, and
whether a served request met them."""

from __future__ import annotations

import pytest

from scheduler_svc.deadlines import first_token_deadline, slo_attained
from services.api import common_pb2 as common

EDF = common.SCHEDULING_POLICY_EDF


def test_no_objective_no_deadline():
    due = first_token_deadline(10.0, common.ServiceObjectives(scheduling=EDF), 0, 16, 0.05)
    assert due.first_token_s is None


def test_the_ttft_slo_sets_the_first_token_deadline():
    objectives = common.ServiceObjectives(scheduling=EDF, ttft_slo_ms=200)
    due = first_token_deadline(10.0, objectives, 0, 16, 0.05)
    assert due.first_token_s == pytest.approx(10.2)
    assert due.objective == "TTFT SLO 200 ms"


def test_a_last_token_deadline_leaves_room_for_the_decode():
    due = first_token_deadline(10.0, common.ServiceObjectives(), 1000, 11, 0.05)
    assert due.first_token_s == pytest.approx(10.5)  # 1 s less 10 decode steps of 50 ms
    assert "deadline_ms 1000 ms less 500 ms" in due.objective


def test_the_request_deadline_overrides_the_deployment_default_and_the_earlier_wins():
    objectives = common.ServiceObjectives(ttft_slo_ms=300, default_deadline_ms=5000)
    own = first_token_deadline(0.0, objectives, 400, 3, 0.1)  # 0.4 - 0.2 = 0.2 < 0.3
    assert own.first_token_s == pytest.approx(0.2) and "deadline_ms 400" in own.objective
    default = first_token_deadline(0.0, objectives, 0, 3, 0.1)  # 5 - 0.2 > 0.3: the SLO
    assert default.first_token_s == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("objectives", "deadline_ms", "timings", "attained"),
    [
        (common.ServiceObjectives(), 0, (900, 90, 5000, 10), None),
        (common.ServiceObjectives(ttft_slo_ms=100), 0, (99, 500, 5000, 10), True),
        (common.ServiceObjectives(ttft_slo_ms=100), 0, (101, 1, 200, 10), False),
        (common.ServiceObjectives(tpot_slo_ms=20), 0, (900, 19, 5000, 10), True),
        (common.ServiceObjectives(tpot_slo_ms=20), 0, (10, 21, 300, 10), False),
        (common.ServiceObjectives(tpot_slo_ms=20), 0, (10, 0, 10, 1), True),  # one token
        (common.ServiceObjectives(), 300, (10, 5, 301, 10), False),
        (common.ServiceObjectives(default_deadline_ms=300), 0, (10, 5, 299, 10), True),
    ],
)
def test_slo_attained(objectives, deadline_ms, timings, attained):
    ttft, tpot, total, tokens = timings
    got = slo_attained(
        objectives, deadline_ms, ttft_ms=ttft, tpot_ms=tpot, total_ms=total, tokens=tokens
    )
    assert got is attained
