"""Queueing policies, driven directly (no asyncio, no server)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler_svc.policies import EdfPolicy, FcfsPolicy, QueueEntry, QueueFull


def entry(name: str, priority: bool = False, arrival_s: float = 0.0, **kw) -> QueueEntry:
    return QueueEntry(request_id=name, arrival_s=arrival_s, priority=priority, **kw)


def drain(policy, now_s: float = 0.0) -> list[str]:
    out = []
    while len(policy):
        admission = policy.pop_ready(now_s, 1)
        assert len(admission.admitted) == 1
        out.append(admission.admitted[0].request_id)
    return out


def test_fcfs_serves_in_arrival_order():
    policy = FcfsPolicy(capacity=10)
    for name in "abcd":
        policy.push(entry(name))
    assert drain(policy) == list("abcd")


def test_fcfs_priority_goes_to_front_keeping_fifo_among_priorities():
    policy = FcfsPolicy(capacity=10)
    for name, priority in [("a", False), ("p1", True), ("b", False), ("p2", True), ("p3", True)]:
        policy.push(entry(name, priority))
    assert drain(policy) == ["p1", "p2", "p3", "a", "b"]


def test_fcfs_admits_at_most_free_slots():
    policy = FcfsPolicy(capacity=10)
    for name in "abc":
        policy.push(entry(name))
    assert policy.pop_ready(0.0, 0).admitted == ()
    assert [e.request_id for e in policy.pop_ready(0.0, 2).admitted] == ["a", "b"]
    assert [e.request_id for e in policy.pop_ready(0.0, 5).admitted] == ["c"]
    assert policy.pop_ready(0.0, 5).admitted == ()


def test_fcfs_capacity_counts_priority_and_normal_together():
    policy = FcfsPolicy(capacity=2)
    policy.push(entry("a"))
    policy.push(entry("p", priority=True))
    with pytest.raises(QueueFull) as full:
        policy.push(entry("b"))
    assert full.value.capacity == 2
    with pytest.raises(QueueFull):
        policy.push(entry("q", priority=True))
    policy.pop_ready(0.0, 1)
    policy.push(entry("b"))
    assert drain(policy) == ["a", "b"]


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        FcfsPolicy(capacity=0)


def test_fcfs_remove_cancelled_entry():
    policy = FcfsPolicy(capacity=10)
    a, b, p = entry("a"), entry("b"), entry("p", priority=True)
    for e in (a, b, p):
        policy.push(e)
    assert policy.remove(b) is True
    assert policy.remove(p) is True
    assert policy.remove(b) is False
    assert policy.remove(entry("a")) is False  # equal fields, another request
    assert len(policy) == 1
    assert drain(policy) == ["a"]


@given(st.lists(st.tuples(st.booleans(), st.integers(min_value=1, max_value=3)), max_size=60))
def test_fcfs_pops_every_entry_once_priorities_first_then_arrival_order(ops):
    """Pushes interleaved with pops of 1–3 slots: each entry comes out exactly once, and
    every pop takes the oldest waiting priority entry, else the oldest waiting one."""
    policy = FcfsPolicy(capacity=1000)
    waiting: list[QueueEntry] = []
    popped: list[QueueEntry] = []
    for i, (priority, slots) in enumerate(ops):
        e = entry(str(i), priority)
        policy.push(e)
        waiting.append(e)
        if i % 2:
            for got in policy.pop_ready(0.0, slots).admitted:
                expected = next((w for w in waiting if w.priority), waiting[0])
                assert got is expected
                waiting.remove(got)
                popped.append(got)
    while len(policy):
        got = policy.pop_ready(0.0, 1).admitted[0]
        assert got is next((w for w in waiting if w.priority), waiting[0])
        waiting.remove(got)
        popped.append(got)
    assert not waiting
    assert len({id(e) for e in popped}) == len(popped) == len(ops)


def test_edf_orders_by_deadline_then_arrival():
    policy = EdfPolicy(capacity=10)
    policy.push(entry("late", deadline_s=30.0))
    policy.push(entry("none-1"))
    policy.push(entry("soon", deadline_s=10.0))
    policy.push(entry("none-2"))
    policy.push(entry("p", priority=True, deadline_s=50.0))
    assert drain(policy) == ["p", "soon", "late", "none-1", "none-2"]


def test_edf_drops_what_cannot_meet_its_deadline():
    policy = EdfPolicy(capacity=10, prefill_s=lambda tokens: 0.001 * sum(tokens))
    policy.push(entry("ok", deadline_s=5.0, prompt_tokens=100))  # prefill 0.1 s
    policy.push(entry("hopeless", deadline_s=1.05, prompt_tokens=100))
    admission = policy.pop_ready(now_s=1.0, free_slots=0)
    assert [e.request_id for e in admission.dropped] == ["hopeless"]
    assert admission.admitted == []
    assert len(policy) == 1


def test_edf_batch_is_the_largest_whose_prefill_meets_the_earliest_deadline():
    policy = EdfPolicy(capacity=10, prefill_s=lambda tokens: 0.1 * len(tokens))
    for i, deadline in enumerate([0.35, 5.0, 5.0, 5.0]):
        policy.push(entry(f"r{i}", deadline_s=deadline))
    # Batch of 3 takes 0.3 s, within r0's 0.35 s; a 4th would push it to 0.4 s.
    first = policy.pop_ready(now_s=0.0, free_slots=4)
    assert [e.request_id for e in first.admitted] == ["r0", "r1", "r2"]
    assert [e.request_id for e in policy.pop_ready(0.0, 4).admitted] == ["r3"]


def test_edf_capacity_and_remove():
    policy = EdfPolicy(capacity=2)
    a, b = entry("a", deadline_s=2.0), entry("b", deadline_s=1.0)
    policy.push(a)
    policy.push(b)
    with pytest.raises(QueueFull):
        policy.push(entry("c"))
    assert policy.remove(b) is True
    assert policy.remove(b) is False
    assert drain(policy) == ["a"]
