"""Admission per deployment replica: a fixed number of concurrent slots and a
policy-ordered wait.

``DeploymentQueue`` lets at most ``slots`` requests run on a replica's worker at once
(the deployment's batch size); the others wait, bounded by the policy's capacity, and are
admitted in the policy's order as slots free up. Each replica of each deployment has its
own queue (named by its group id, ``services.ids.replica_group_id``), so a slow replica
never holds up another. :meth:`QueueRegistry.shortest_wait` says which replica a request
should join; a replica that has a slot free and nothing waiting takes the next request
waiting on another replica of its deployment (the request's wait was predicted, and a
replica can free early), and ``acquire`` says which replica admitted it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

from scheduler_svc.policies import EdfPolicy, FcfsPolicy, QueueEntry, QueueFull, QueuePolicy
from scheduler_svc.predictor import LatencyPredictor
from services import replicas
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.errors import DeadlineExceeded, DeadlineUnreachable, ResourceExhausted
from services.ids import replica_group_id, split_group_id

log = logging.getLogger("iserve.scheduler")

Clock = Callable[[], float]
# After a waiting request's last start: its prediction then says it misses.
_WAKE_MARGIN_S = 1e-3
PolicyFactory = Callable[[int], QueuePolicy]


class QueueClosed(Exception):
    """The replica stopped serving (removed, or taken out) while the request waited."""


# An idle queue that has admitted nothing for this long admits a request it predicts
# late rather than refuse it: refusing every request, it would never measure that its
# predictions were too slow (after a burst that slowed the machine, say).
RELEARN_AFTER_S = 10.0


def slots_for(batch_size: int) -> int:
    """Concurrent requests a deployment serves: its batch size, where 0 means 1."""
    return max(1, batch_size)


class DeploymentQueue:
    """Slots and waiting requests of one deployment. Use from one event loop only.

    A request holds a slot from a successful ``acquire`` until its ``release``.
    """

    def __init__(
        self, deployment_id: str, slots: int, policy: QueuePolicy, clock: Clock = time.perf_counter
    ):
        self.deployment_id = deployment_id
        self._slots = slots_for(slots)
        self._policy = policy
        self._clock = clock
        # Requests holding a slot, with when each was admitted.
        self._running: dict[QueueEntry, float] = {}
        self._last_admitted = clock()
        # The requests running, integrated over time (sequence-seconds) up to
        # _occupancy_at: the mean running over any span (see mean_running_since).
        self._occupancy = 0.0
        self._occupancy_at = clock()
        self._waiters: dict[QueueEntry, asyncio.Future[None]] = {}
        # EDF: wakes the queue when a waiting request's last start for its deadline comes.
        self._deadline_timer: asyncio.TimerHandle | None = None
        # What this deployment's requests take; QueueRegistry gives every queue one.
        self.predictor: LatencyPredictor | None = None
        self.model_id = ""  # whose deployment it is (QueueRegistry sets it)
        # Which replica of which deployment it admits to, and the queues of that
        # deployment's other replicas (QueueRegistry sets them): whose waiting requests
        # this one takes when it has a slot free and none of its own waiting.
        self.replica_index = 0
        self.siblings: Callable[[], list[DeploymentQueue]] = list
        # When QueueRegistry.choose_replica last sent a request here (its count of
        # choices; 0: never): ties go to the replica chosen least recently.
        self.chosen_at = 0
        self._closed = False

    @property
    def described(self) -> str:
        """``deployment D``, or ``deployment D (replica i)``: the id a client knows, not
        the worker group id ``D.r<i>`` a replica's queue is named by."""
        deployment_id, index = split_group_id(self.deployment_id)
        return f"deployment {deployment_id}" + (f" (replica {index})" if index else "")

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._policy)

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def edf(self) -> bool:
        """Whether this queue orders and refuses by deadline (EDF), else FCFS."""
        return isinstance(self._policy, EdfPolicy)

    def occupancy_mark(self) -> tuple[float, float]:
        """Now, and the requests holding a slot integrated over time up to now
        (sequence-seconds): where a span :meth:`mean_running_since` averages starts."""
        self._count_occupancy()
        return self._occupancy_at, self._occupancy

    def mean_running_since(self, mark: tuple[float, float] | None) -> float:
        """The mean number of sequences the worker ran side by side from ``mark`` (an
        :meth:`occupancy_mark`) to now, time weighted; the count now without a span."""
        now, occupancy = self.occupancy_mark()
        if mark is None or now <= mark[0]:
            return float(max(1, self.running))
        return max(1.0, (occupancy - mark[1]) / (now - mark[0]))

    def _count_occupancy(self) -> None:
        """Bring the integral up to now; called before every change of ``_running``."""
        now = self._clock()
        self._occupancy += len(self._running) * max(0.0, now - self._occupancy_at)
        self._occupancy_at = max(now, self._occupancy_at)

    @property
    def slots(self) -> int:
        return self._slots

    @slots.setter
    def slots(self, slots: int) -> None:
        self._slots = slots_for(slots)
        self._dispatch()

    def expected_wait_s(
        self, unmeasured_service_s: float = 1.0, predictor: LatencyPredictor | None = None
    ) -> float:
        """How long a request arriving now would wait for a slot, in seconds: the
        requests running here hold their slots until their predicted ends, those waiting
        each take the first slot to free in turn (as the EDF check plays them), and it
        takes the first slot to free after them.

        Each request holds its slot for its own predicted service, its prompt and
        max_tokens priced by ``predictor`` (default this queue's: the deployment's
        estimate, corrected by the requests finished here). One without max_tokens, or
        under a predictor that knows nothing yet (no estimate, nothing finished), holds
        it for the mean service time measured here, or ``unmeasured_service_s`` before
        any request has finished. Without any predictor: the requests here."""
        own = self.predictor
        if own is None:
            return float(self._running + len(self._waiters))
        predictor = predictor or own

        def service(entry: QueueEntry) -> float:
            if entry.max_tokens > 0 and predictor.evidence > 0:
                return predictor.service_s(entry.prompt_tokens, entry.max_tokens, self._slots)
            return own.mean_service_s if own.service_measured else unmeasured_service_s

        now = self._clock()
        free = self._slot_free_times(now, service)
        for entry in self._waiters:
            heapq.heapreplace(free, free[0] + service(entry))
        return free[0] - now

    def _slot_free_times(self, now: float, service: Callable[[QueueEntry], float]) -> list[float]:
        """A heap of the times the slots free: each running request holds its slot until
        its admission plus its ``service``, and not before ``now``; a free slot frees
        ``now``. More running than slots (the batch size was lowered): the first to end
        free none."""
        slots = self._slots
        ends = sorted(max(now, admitted + service(e)) for e, admitted in self._running.items())
        free = ends[-slots:] if len(ends) >= slots else ends + [now] * (slots - len(ends))
        heapq.heapify(free)
        return free

    async def acquire(self, entry: QueueEntry) -> DeploymentQueue:
        """Wait until ``entry`` holds a slot, in policy order; returns the queue whose
        slot it holds (this one, or a sibling replica's that took it while it waited),
        which its ``release`` goes to.

        Raises ResourceExhausted when the queue is full, DeadlineExceeded when the
        policy drops the request, and DeadlineUnreachable (an InvalidArgument) for an
        ``entry.unreachable``. A caller cancelled while waiting leaves the queue and holds
        no slot.
        """
        policy, edf = self._policy, self.edf
        # At once: waiting would only report it when a slot frees, seconds later.
        if (
            (edf or entry.refused_if_late)
            and entry.deadline_s is not None
            and entry in self._predicted_misses([*policy.ahead_of(entry), entry], refusing=edf)
            and not self._measures_instead(entry)
        ):
            raise self._miss(entry)
        try:
            self._policy.push(entry)
        except QueueFull as full:
            raise ResourceExhausted(
                f"queue of {self.described} is full ({full.capacity} waiting)"
            ) from None
        waiter: asyncio.Future[DeploymentQueue] = asyncio.get_running_loop().create_future()
        self._waiters[entry] = waiter
        self._dispatch()
        try:
            return await waiter
        except asyncio.CancelledError:
            self._waiters.pop(entry, None)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Admitted in the same loop iteration as the cancellation: hand it back.
                waiter.result().release(entry)
            else:
                self._policy.remove(entry)
            raise

    def _measures_instead(self, entry: QueueEntry) -> bool:
        """Whether ``entry``, predicted late, is admitted to measure again: on an EDF
        queue (where every request has a deadline; FCFS goes on learning from those
        without) when nothing runs or waits here and nothing was admitted for
        RELEARN_AFTER_S. Never one whose own decode passes its deadline (``unreachable``):
        no measurement makes it reachable, and it held the only slot for seconds before
        the same request, sent again, was refused (a tester)."""
        if (
            not self.edf
            or entry.unreachable
            or self._running
            or len(self._policy)
            or self._clock() - self._last_admitted < RELEARN_AFTER_S
        ):
            return False
        entry.not_refused_late = True
        log.info(
            "%s admits request %s although its first token is predicted late: nothing was "
            "admitted for %.0f s, and it measures again",
            self.described,
            entry.request_id or "-",
            RELEARN_AFTER_S,
        )
        return True

    def _predicted_misses(
        self, ordered: list[QueueEntry], refusing: bool = True
    ) -> list[QueueEntry]:
        """The requests of ``ordered`` (waiting, in the order they would start) predicted
        to miss their deadlines, each given its predicted first-token time; none before
        a request has finished here (nothing is known of service times yet).
        ``refusing``: the policy refuses a request predicted to miss (EDF); else (FCFS)
        it is served late, and holds its slot for those after it.

        Each running request holds its slot until its admission plus its predicted
        service (``LatencyPredictor.service_s``: its own prompt and max_tokens), and not
        before now; each request of ``ordered`` takes the first slot to free, in turn,
        and its first token follows its prefill. A request predicted to miss is taken to
        be refused: it holds no slot for those after it."""
        predictor = self.predictor
        if predictor is None or not predictor.service_measured:
            return []
        slots = self._slots

        def service(entry: QueueEntry) -> float:
            return predictor.service_s(entry.prompt_tokens, entry.max_tokens, slots)

        free = self._slot_free_times(self._clock(), service)
        missed = []
        # Requests that start at one time are prefilled together: each first token waits
        # for every prompt of them, as the worker's step returns them together.
        together: list[int] = []
        together_at: float | None = None
        for entry in ordered:
            start = free[0]
            prompts = (
                [*together, entry.prompt_tokens] if start == together_at else [entry.prompt_tokens]
            )
            first_token = start + predictor.prefill_s(prompts)
            if (
                entry.deadline_s is not None
                and not entry.not_refused_late
                and first_token > entry.deadline_s
            ):
                entry.predicted_first_token_s = first_token
                missed.append(entry)
                if refusing:
                    continue
            together, together_at = prompts, start
            heapq.heapreplace(free, start + service(entry))
        return missed

    def release(self, entry: QueueEntry) -> None:
        """Give back the slot ``entry`` took in ``acquire`` and admit whoever is next."""
        self._count_occupancy()
        if self._running.pop(entry, None) is None:
            raise RuntimeError(f"release without acquire on deployment {self.deployment_id}")
        self._dispatch()

    @contextlib.asynccontextmanager
    async def slot(self, entry: QueueEntry) -> AsyncIterator[None]:
        """``async with queue.slot(entry):`` holds a slot for the body."""
        holder = await self.acquire(entry)
        try:
            yield
        finally:
            holder.release(entry)

    def _dispatch(self) -> None:
        policy = self._policy
        if isinstance(policy, EdfPolicy):
            # The arrival check again, on everything still waiting.
            for entry in self._predicted_misses(policy.ordered()):
                policy.remove(entry)
                self._refuse(entry)
        while len(policy):
            now = self._clock()
            admission = policy.pop_ready(now, self._slots - len(self._running))
            for entry in admission.dropped:
                self._refuse(entry)
            skipped_cancelled = False
            for entry in admission.admitted:
                waiter = self._waiters.pop(entry, None)
                if waiter is None or waiter.done():
                    skipped_cancelled = True  # its slot goes to the next in line
                    continue
                self._count_occupancy()
                self._running[entry] = now
                self._last_admitted = now
                waiter.set_result(self)
            if not skipped_cancelled:
                break
        if isinstance(policy, EdfPolicy):
            self._wake_at_last_start(policy)
        self.take_waiting()

    def reopen(self) -> None:
        """The replica serves again (after :meth:`close`): requests join and leave it as
        before, and it takes its siblings' waiting requests again."""
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def take_waiting(self) -> None:
        """With a slot free and nothing of its own waiting, admit here the requests next
        in line on the sibling replicas, the longest queue's first. Each release and
        arrival here does; the registry does it for a replica that has neither, such as
        one just back in service."""
        if self._closed or len(self._policy):
            return
        while len(self._running) < self._slots:
            donors = [q for q in self.siblings() if q is not self and not q._closed and q.waiting]
            if not donors:
                return
            max(donors, key=lambda q: q.waiting)._hand_over_next(self)

    def _hand_over_next(self, taker: DeploymentQueue) -> None:
        """Admit the request next in this queue's order on ``taker``'s slot (refusing
        first those the policy drops, as its own dispatch would)."""
        now = self._clock()
        admission = self._policy.pop_ready(now, 1)
        for entry in admission.dropped:
            self._refuse(entry)
        for entry in admission.admitted:
            waiter = self._waiters.pop(entry, None)
            if waiter is not None and not waiter.done():
                taker._count_occupancy()
                taker._running[entry] = now
                taker._last_admitted = now
                waiter.set_result(taker)
        if isinstance(self._policy, EdfPolicy):
            self._wake_at_last_start(self._policy)

    def close(self) -> None:
        """The replica no longer serves: every waiting request leaves with QueueClosed at
        once (rather than waiting for a slot on a worker that is draining or gone).
        Running requests keep their slots until they end."""
        self._closed = True
        policy = self._policy
        for entry, waiter in list(self._waiters.items()):
            policy.remove(entry)
            del self._waiters[entry]
            if not waiter.done():
                waiter.set_exception(QueueClosed(f"{self.described} stopped serving"))

    def _refuse(self, entry: QueueEntry) -> None:
        waiter = self._waiters.pop(entry, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(self._miss(entry))

    def _miss(self, entry: QueueEntry) -> DeadlineExceeded | DeadlineUnreachable:
        """The refusal of ``entry``, whose deadline is predicted missed: DeadlineUnreachable
        when no queue could meet it (``entry.unreachable``), else DeadlineExceeded."""
        message = self._miss_message(entry)
        return (DeadlineUnreachable if entry.unreachable else DeadlineExceeded)(message)

    def unreachable_refusal(self, entry: QueueEntry, first_token_s: float) -> DeadlineUnreachable:
        """The refusal of ``entry``, whose own decode alone passes its deadline, as another
        replica of the deployment measured it (this one has measured nothing to predict a
        miss from): its first token predicted at ``first_token_s``."""
        entry.predicted_first_token_s = first_token_s
        return DeadlineUnreachable(self._miss_message(entry))

    def _wake_at_last_start(self, policy: EdfPolicy) -> None:
        """Dispatch again when the first waiting request's deadline can no longer be met
        even if it started then (its deadline less its prefill), though nothing arrives
        or ends before: it is refused then, not at the next arrival or release."""
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        last_start = policy.last_start()
        if last_start is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop: nothing to wake
            return
        self._deadline_timer = loop.call_later(
            max(0.0, last_start - self._clock()) + _WAKE_MARGIN_S, self._dispatch
        )

    def _miss_message(self, entry: QueueEntry) -> str:
        text = f"request {entry.request_id or '-'} cannot meet its deadline on {self.described}"
        if entry.predicted_first_token_s is None or entry.deadline_s is None:
            return text
        predicted_ms = (entry.predicted_first_token_s - entry.arrival_s) * 1e3
        allowed_ms = (entry.deadline_s - entry.arrival_s) * 1e3
        why = f" ({entry.objective})" if entry.objective else ""
        # A deadline on the last token less the predicted decode of max_tokens can fall
        # before the arrival: no first token could be on time, whatever the queue (decoded
        # alone: unreachable), or none beside the sequences running now.
        hint = ""
        if entry.unreachable:
            hint = (
                f"; the decode of max_tokens ({entry.max_tokens}) alone takes longer than "
                "the deadline: ask for fewer tokens or a later deadline"
            )
        elif allowed_ms <= 0:
            hint = (
                f"; the decode of max_tokens ({entry.max_tokens}) beside the sequences "
                "running now takes longer than the deadline: ask for fewer tokens or a later "
                "deadline, or retry"
            )
        return (
            f"{text}: first token predicted {predicted_ms:.0f} ms after arrival, "
            f"allowed {allowed_ms:.0f} ms{why}{hint}"
        )


class QueueRegistry:
    """One ``DeploymentQueue`` per deployment, created on first use with the policy the
    deployment's objectives name (FCFS or EDF) and its own :class:`LatencyPredictor`.

    ``capacity`` is how many requests may wait per deployment (running ones not counted).
    ``policy_factory``, when given, replaces the deployment's policy (tests).
    ``move_waiting`` False keeps each request on the replica it joined (a bench's peer).
    """

    def __init__(
        self,
        capacity: int,
        policy_factory: PolicyFactory | None = None,
        clock: Clock = time.perf_counter,
        move_waiting: bool = True,
    ):
        if capacity < 1:
            raise ValueError(f"queue capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._policy_factory = policy_factory
        self._clock = clock
        self._move_waiting = move_waiting
        self._queues: dict[str, DeploymentQueue] = {}
        # Deployment id -> the replicas that serve (set_serving), whose queues take
        # requests waiting on their siblings.
        self._serving: dict[str, frozenset[int]] = {}
        # Queues the last prune did not keep.
        self._left_out: set[str] = set()
        self._choices = itertools.count(1)

    def queue_for(self, deployment: deploy_pb.Deployment, replica: int = 0) -> DeploymentQueue:
        """The queue of one replica of the deployment (each has its own slots, waiting
        requests and predictor), its slots following the batch size (0 means 1)."""
        group = replica_group_id(deployment.deployment_id, replica)
        batch_size = deployment.config.batch_size
        queue = self._queues.get(group)
        if queue is None:
            predictor = LatencyPredictor(
                deployment.latency_model, deployment.max_input_tokens, slots_for(batch_size)
            )
            queue = DeploymentQueue(
                group, batch_size, self._policy(deployment, predictor), self._clock
            )
            queue.predictor = predictor
            queue.model_id = deployment.model_id
            queue.replica_index = replica
            if self._move_waiting:
                queue.siblings = lambda me=queue, deployment_id=deployment.deployment_id: (
                    self._siblings(me, deployment_id)
                )
            self._queues[group] = queue
        else:
            if queue.closed:  # asked for again: its replica serves again
                queue.reopen()
            if queue.slots != slots_for(batch_size):
                queue.slots = batch_size
        return queue

    def serving_now(self, deployment: deploy_pb.Deployment) -> None:
        """:meth:`set_serving`, then each serving replica with a slot free and nothing of
        its own waiting takes the requests waiting on the others. A replica back in
        service after a restart has no arrival or release of its own to do so: it stayed
        idle while its sibling's queue drained one request at a time."""
        self.set_serving(deployment)
        if not self._move_waiting:
            return
        serving = replicas.serving(deployment)
        if len(serving) < 2:
            return
        queues = [self.queue_for(deployment, r.index) for r in serving]
        if any(q.waiting for q in queues):
            for queue in queues:
                queue.take_waiting()

    def waiting_on(self, deployment: deploy_pb.Deployment) -> int:
        """Requests waiting on every replica of ``deployment`` (its queues looked up by
        group id, not by a scan of every queue at each admission)."""
        groups = (
            replica_group_id(deployment.deployment_id, r.index)
            for r in replicas.replicas_of(deployment)
        )
        return sum(q.waiting for q in map(self._queues.get, groups) if q is not None)

    def check_room(self, deployment: deploy_pb.Deployment) -> None:
        """ResourceExhausted when ``capacity`` requests wait on the deployment's replicas
        together (a replica's own queue holds at most as many): the capacity is the
        deployment's, as ISERVE_QUEUE_CAPACITY says, whatever its replicas."""
        count = len(replicas.replicas_of(deployment))
        if count < 2:
            return  # its one queue's policy says so
        waiting = self.waiting_on(deployment)
        if waiting >= self.capacity:
            serving = len(replicas.serving(deployment))
            # Those that serve: "on its 2 replicas" of one with a replica FAILED (a probe).
            on = (
                f"its {count} replicas"
                if serving == count
                else f"{serving} of its {count} replicas serving"
            )
            raise ResourceExhausted(
                f"queue of deployment {deployment.deployment_id} is full ({waiting} waiting "
                f"on {on})"
            )

    def best_informed(self, deployment: deploy_pb.Deployment) -> LatencyPredictor | None:
        """The predictor of ``deployment``'s serving replica that knows most (its requests
        measured, or the deployment's estimate: ``LatencyPredictor.evidence``): the
        replicas run one configuration, so it judges for all of them (a replica that had
        measured nothing served a request its sibling had just found hopeless, late, with
        success). None when no replica serves."""
        queues = [self.queue_for(deployment, r.index) for r in replicas.serving(deployment)]
        informed = [q.predictor for q in queues if q.predictor is not None]
        return max(informed, key=lambda p: p.evidence, default=None)

    def set_serving(self, deployment: deploy_pb.Deployment) -> None:
        """Record which replicas of ``deployment`` serve now (the scheduler's view: its
        records, less the workers it found gone): only those take requests waiting on
        another (a replica restarting, or taken out, took them back each time it freed)."""
        self._serving[deployment.deployment_id] = frozenset(
            r.index for r in replicas.serving(deployment)
        )

    def _siblings(self, queue: DeploymentQueue, deployment_id: str) -> list[DeploymentQueue]:
        """The queues of ``queue``'s deployment whose requests it may take: none unless it
        serves; those of the other serving replicas."""
        serving = self._serving.get(deployment_id, frozenset())
        if queue.replica_index not in serving:
            return []
        found = (self._queues.get(replica_group_id(deployment_id, i)) for i in serving)
        return [q for q in found if q is not None and q is not queue]

    def _policy(self, deployment: deploy_pb.Deployment, predictor: LatencyPredictor):
        if self._policy_factory is not None:
            return self._policy_factory(self.capacity)
        if deployment.objectives.scheduling == common.SCHEDULING_POLICY_EDF:
            return EdfPolicy(self.capacity, predictor.prefill_s)
        return FcfsPolicy(self.capacity)

    def get(self, deployment_id: str) -> DeploymentQueue | None:
        return self._queues.get(deployment_id)

    def shortest_wait(self, deployment: deploy_pb.Deployment) -> tuple[float, int]:
        """(expected wait in seconds, replica index) of the deployment's serving replica
        a request should go to: the one with the shortest expected wait
        (:meth:`DeploymentQueue.expected_wait_s`: each request there priced by its own
        max_tokens, under the predictor of the replica that knows most, as every replica
        runs the same configuration); on equal waits the one with fewer requests running and waiting,
        then the one :meth:`choose_replica` chose least recently (idle replicas take
        requests that come one at a time in turn: the lowest index took them all), then
        the lowest index. (inf, 0) when no replica serves.

        A full queue waits forever (a request there would be refused while another copy
        has room). A request without max_tokens on a copy where none has finished yet is
        charged the slowest mean service time measured on the model's other copies (1 s
        when none is). Mean service times alone priced a copy whose first request was
        short as 10-20x faster than it is, and it took most requests while the other
        idled."""
        choices = []
        unmeasured: float | None = None  # the model's slowest measured, when first needed
        queues = [(r, self.queue_for(deployment, r.index)) for r in replicas.serving(deployment)]
        # The replicas run one configuration: the predictor that knows most prices them all.
        shared = self.best_informed(deployment)
        for replica, queue in queues:
            load = queue.running + queue.waiting
            if queue.waiting >= self.capacity:
                wait_s = float("inf")
            elif queue.predictor is not None and not queue.predictor.service_measured:
                if unmeasured is None:
                    unmeasured = self._unmeasured_service_s(deployment.model_id)
                wait_s = queue.expected_wait_s(unmeasured, shared)
            else:
                wait_s = queue.expected_wait_s(predictor=shared)
            choices.append((wait_s, load, queue.chosen_at, replica.index))
        wait_s, _, _, index = min(choices, default=(float("inf"), 0, 0, 0))
        return wait_s, index

    def choose_replica(self, deployment: deploy_pb.Deployment) -> int:
        """The replica a request is sent to (:meth:`shortest_wait`), noted as chosen."""
        _, index = self.shortest_wait(deployment)
        self.queue_for(deployment, index).chosen_at = next(self._choices)
        return index

    def _unmeasured_service_s(self, model_id: str) -> float:
        measured = [
            q.predictor.mean_service_s
            for q in self._queues.values()
            if q.model_id == model_id and q.predictor is not None and q.predictor.service_measured
        ]
        return max(measured, default=1.0)

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(queue id, running, waiting) of every queue. Safe to call from another thread
        (a metrics scrape): the queues are copied in one step, which holds the GIL."""
        return [(d, q.running, q.waiting) for d, q in list(self._queues.items())]

    def predictions(self) -> list[tuple[str, LatencyPredictor]]:
        """(queue id, its predictor) of every queue; safe from another thread, as
        :meth:`snapshot` (a predictor replaces its coefficients in one assignment)."""
        return [(d, q.predictor) for d, q in list(self._queues.items()) if q.predictor]

    def prune(self, keep: Iterable[str], removing: Iterable[str] = ()) -> None:
        """Close the queues of replicas not in ``keep`` two calls in a row (they no longer
        serve: once alone may be a deployment created while ``keep`` was read), at once
        for the deployments in ``removing`` (their records say so), and forget idle
        queues not in ``keep``."""
        keep, removing = set(keep), set(removing)
        left_out = {d for d in self._queues if d not in keep}
        for deployment_id in left_out:
            queue = self._queues[deployment_id]
            if deployment_id in self._left_out or split_group_id(deployment_id)[0] in removing:
                queue.close()
            if queue.running == 0 and queue.waiting == 0:
                del self._queues[deployment_id]
        self._left_out = left_out & self._queues.keys()
        alive = {split_group_id(g)[0] for g in self._queues}
        self._serving = {d: r for d, r in self._serving.items() if d in alive}
