"""Queueing policies: which waiting request a deployment serves next.

Pure data structures (no asyncio, gRPC or Redis), so tests and the simulator drive them
directly. ``queues.DeploymentQueue`` wraps a policy with slots and waiting tasks.

Every policy has the same interface (``QueuePolicy``): ``push`` a request, ``remove`` one
whose client went away, and ``pop_ready(now_s, free_slots)``, which says which requests
start now and which are dropped because they can no longer meet their deadline.

- ``FcfsPolicy``: first come, first served; priority requests go to the front, in their
  own arrival order (the papers' default and MaverIQ's ``prior_inference``).
- ``EdfPolicy``: earliest deadline first (FineServe): deadline = arrival + SLO; requests
  that cannot meet their deadline even if started now are dropped, and the batch started
  is the largest whose predicted prefill finishes before the earliest deadline in it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(eq=False, slots=True)
class QueueEntry:
    """One request waiting for a slot. Compared by identity: two requests are never equal.

    Times are seconds on the queue's monotonic clock.
    """

    request_id: str
    arrival_s: float
    priority: bool = False
    # Absolute time by which the first token is due; None: no deadline.
    deadline_s: float | None = None
    # Prompt length, for policies that predict prefill time; 0 when unknown.
    prompt_tokens: int = 0
    # Tokens it may generate, for a prediction of how long it holds its slot; 0 unknown.
    max_tokens: int = 0
    # Where the deadline comes from, for the refusal message ("TTFT SLO 200 ms").
    objective: str = ""
    # Set by a policy that drops the request: when its first token was predicted.
    predicted_first_token_s: float | None = None
    # Refused at admission when its first token is predicted past ``deadline_s``, by any
    # policy (EDF refuses such requests always; FCFS only those marked so).
    refused_if_late: bool = False
    # Never refused for a predicted miss (its deadline still orders it): a text prompt
    # guessed longer than the deployment accepts, which the worker counts and refuses
    # as too long; or one an idle queue admits to measure again (DeploymentQueue).
    not_refused_late: bool = False
    # Its deadline falls before its arrival even with its decode predicted alone, in a
    # batch of one: no queue could meet it (refused as DeadlineUnreachable, not as late).
    unreachable: bool = False


@dataclass(frozen=True, slots=True)
class Admission:
    """Outcome of ``QueuePolicy.pop_ready``: requests to start now, requests to reject."""

    admitted: Sequence[QueueEntry] = ()
    dropped: Sequence[QueueEntry] = ()


NOTHING = Admission()


class QueueFull(Exception):
    """The policy already holds ``capacity`` waiting requests."""

    def __init__(self, capacity: int):
        super().__init__(f"{capacity} waiting")
        self.capacity = capacity


class QueuePolicy(Protocol):
    """What ``DeploymentQueue`` needs from a policy."""

    capacity: int

    def __len__(self) -> int:
        """Requests waiting."""
        ...

    def push(self, entry: QueueEntry) -> None:
        """Add a waiting request; raises QueueFull when ``capacity`` are waiting."""
        ...

    def remove(self, entry: QueueEntry) -> bool:
        """Forget a waiting request (its client cancelled); False when it is not waiting."""
        ...

    def ahead_of(self, entry: QueueEntry) -> list[QueueEntry]:
        """The waiting requests that would start before ``entry`` were it pushed now."""
        ...

    def pop_ready(self, now_s: float, free_slots: int) -> Admission:
        """Take out the requests to start now (at most ``free_slots``) and those to drop."""
        ...


def _check_capacity(capacity: int) -> int:
    if capacity < 1:
        raise ValueError(f"queue capacity must be at least 1, got {capacity}")
    return capacity


class FcfsPolicy:
    """First come, first served; priority requests ahead of all others, FIFO among
    themselves. ``capacity`` bounds the waiting requests of both kinds together."""

    def __init__(self, capacity: int):
        self.capacity = _check_capacity(capacity)
        self._priority: deque[QueueEntry] = deque()
        self._normal: deque[QueueEntry] = deque()

    def __len__(self) -> int:
        return len(self._priority) + len(self._normal)

    def push(self, entry: QueueEntry) -> None:
        if len(self._priority) + len(self._normal) >= self.capacity:
            raise QueueFull(self.capacity)
        (self._priority if entry.priority else self._normal).append(entry)

    def remove(self, entry: QueueEntry) -> bool:
        waiting = self._priority if entry.priority else self._normal
        try:
            waiting.remove(entry)
        except ValueError:
            return False
        return True

    def ahead_of(self, entry: QueueEntry) -> list[QueueEntry]:
        """The waiting requests that would start before ``entry`` were it pushed now."""
        return [*self._priority] if entry.priority else [*self._priority, *self._normal]

    def pop_ready(self, now_s: float, free_slots: int) -> Admission:
        if free_slots <= 0 or not (self._priority or self._normal):
            return NOTHING
        admitted = []
        while len(admitted) < free_slots and (self._priority or self._normal):
            admitted.append((self._priority or self._normal).popleft())
        return Admission(admitted=admitted)


PrefillModel = Callable[[Sequence[int]], float]
"""Predicted prefill time (seconds) of a batch, given each request's prompt tokens."""


def no_prefill_cost(prompt_tokens: Sequence[int]) -> float:
    """The trivial prefill model: free. EDF then only drops requests already late."""
    return 0.0


@dataclass(order=True, slots=True)
class _EdfKey:
    rank: int  # 0 for priority requests, so they come first
    deadline_s: float  # +inf when the request has none
    seq: int  # arrival order breaks ties
    entry: QueueEntry = field(compare=False)


class EdfPolicy:
    """Earliest deadline first with SLO-aware batching (FineServe).

    ``prefill_s(prompt_tokens)`` predicts how long the prefill of a batch takes.
    Requests without a deadline sort after all that have one, in arrival order;
    priority requests sort before everything.
    """

    def __init__(self, capacity: int, prefill_s: PrefillModel = no_prefill_cost):
        self.capacity = _check_capacity(capacity)
        self._prefill_s = prefill_s
        self._heap: list[_EdfKey] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, entry: QueueEntry) -> None:
        if len(self._heap) >= self.capacity:
            raise QueueFull(self.capacity)
        key = _EdfKey(0 if entry.priority else 1, _deadline(entry), next(self._seq), entry)
        heapq.heappush(self._heap, key)

    def remove(self, entry: QueueEntry) -> bool:
        for i, key in enumerate(self._heap):
            if key.entry is entry:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def ordered(self) -> list[QueueEntry]:
        """The waiting requests in the order they would start."""
        return [key.entry for key in sorted(self._heap)]

    def ahead_of(self, entry: QueueEntry) -> list[QueueEntry]:
        """The waiting requests that would start before ``entry`` were it pushed now (on
        an equal deadline, those already waiting)."""
        rank, deadline = (0 if entry.priority else 1), _deadline(entry)
        return [k.entry for k in sorted(self._heap) if (k.rank, k.deadline_s) <= (rank, deadline)]

    def last_start(self) -> float | None:
        """The earliest time by which a waiting request must start to meet its deadline
        (its deadline less its predicted prefill); None when none has a deadline."""
        return min(
            (
                key.deadline_s - self._prefill_s([key.entry.prompt_tokens])
                for key in self._heap
                if key.entry.deadline_s is not None
            ),
            default=None,
        )

    def pop_ready(self, now_s: float, free_slots: int) -> Admission:
        dropped = self._drop_hopeless(now_s)
        batch: list[QueueEntry] = []
        if free_slots > 0 and self._heap:
            first = heapq.heappop(self._heap).entry
            batch.append(first)
            earliest = _deadline(first)
            tokens = [first.prompt_tokens]
            while len(batch) < free_slots and self._heap:
                candidate = self._heap[0].entry
                with_candidate = min(earliest, _deadline(candidate))
                if now_s + self._prefill_s([*tokens, candidate.prompt_tokens]) > with_candidate:
                    break
                batch.append(heapq.heappop(self._heap).entry)
                tokens.append(candidate.prompt_tokens)
                earliest = with_candidate
        if not batch and not dropped:
            return NOTHING
        return Admission(admitted=batch, dropped=dropped)

    def _drop_hopeless(self, now_s: float) -> list[QueueEntry]:
        """Remove the requests that miss their deadline even if started alone right now;
        each gets its predicted first-token time."""
        hopeless = []
        for key in self._heap:
            entry = key.entry
            if entry.deadline_s is None or entry.not_refused_late:
                continue
            first_token_s = now_s + self._prefill_s([entry.prompt_tokens])
            if first_token_s > entry.deadline_s:
                entry.predicted_first_token_s = first_token_s
                hopeless.append(key)
        if not hopeless:
            return []
        gone = {id(key) for key in hopeless}
        self._heap = [key for key in self._heap if id(key) not in gone]
        heapq.heapify(self._heap)
        return [key.entry for key in sorted(hopeless)]


def _deadline(entry: QueueEntry) -> float:
    return math.inf if entry.deadline_s is None else entry.deadline_s
