"""The device load ring: busy seconds over the last 120 one-second samples / 120."""

from __future__ import annotations

import pytest

from monitor_agent.load import LOAD_WINDOW_SAMPLES, LoadRing


def test_a_new_ring_reports_no_load():
    ring = LoadRing()
    assert ring.window == LOAD_WINDOW_SAMPLES == 120
    assert ring.load == 0.0


def test_samples_not_yet_taken_count_as_idle():
    ring = LoadRing()
    for _ in range(30):
        ring.add(1.0)
    assert ring.busy_samples == 30
    assert ring.load == pytest.approx(30 / 120)


def test_a_fully_busy_window_is_load_one_and_stays_there():
    ring = LoadRing()
    for _ in range(500):
        ring.add(0.5)
    assert ring.load == 1.0


def test_old_samples_fall_out_of_the_window():
    ring = LoadRing(window=4)
    for utilisation in (1.0, 1.0, 0.0, 1.0):
        ring.add(utilisation)
    assert ring.load == 0.75
    ring.add(0.0)  # drops the first busy sample
    assert ring.load == 0.5
    ring.add(0.0)  # drops the second busy sample
    assert ring.load == 0.25
    ring.add(0.0)  # drops an idle sample
    assert ring.load == 0.25
    ring.add(0.0)
    assert ring.load == 0.0


def test_a_second_counts_busy_only_above_one_percent():
    ring = LoadRing(window=3)
    ring.add(0.01)
    ring.add(0.0)
    assert ring.load == 0.0
    ring.add(0.0101)
    assert ring.busy_samples == 1


def test_the_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be positive"):
        LoadRing(window=0)
