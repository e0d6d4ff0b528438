"""DeploymentQueue and QueueRegistry on a real event loop (no server)."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler_svc.policies import EdfPolicy, FcfsPolicy, QueueEntry
from scheduler_svc.predictor import LatencyPredictor
from scheduler_svc.queues import RELEARN_AFTER_S, DeploymentQueue, QueueClosed, QueueRegistry
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.errors import DeadlineExceeded, DeadlineUnreachable, ResourceExhausted

READY = deploy_pb.DEPLOYMENT_STATE_READY


def entry(name: str, priority: bool = False, **kw) -> QueueEntry:
    return QueueEntry(request_id=name, arrival_s=0.0, priority=priority, **kw)


def deployment(deployment_id: str, batch_size: int, **fields) -> deploy_pb.Deployment:
    return deploy_pb.Deployment(
        deployment_id=deployment_id,
        config=common.DeploymentConfig(batch_size=batch_size),
        **fields,
    )


async def settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_slots_limit_concurrency_and_admit_in_order():
    async def scenario():
        queue = DeploymentQueue("d1", slots=2, policy=FcfsPolicy(capacity=10))
        started: list[str] = []
        entries = {name: entry(name, priority=name == "p") for name in "abcdp"}

        async def request(name: str, priority: bool = False):
            await queue.acquire(entries[name])
            started.append(name)

        tasks = [asyncio.create_task(request(n)) for n in ("a", "b", "c", "d")]
        await settle()
        tasks.append(asyncio.create_task(request("p", priority=True)))
        await settle()
        assert started == ["a", "b"]
        assert (queue.running, queue.waiting) == (2, 3)
        queue.release(entries["a"])
        await settle()
        assert started == ["a", "b", "p"]
        queue.release(entries["b"])
        queue.release(entries["p"])
        await settle()
        assert started == ["a", "b", "p", "c", "d"]
        assert (queue.running, queue.waiting) == (2, 0)
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_batch_size_zero_means_one_slot():
    assert DeploymentQueue("d1", slots=0, policy=FcfsPolicy(capacity=1)).slots == 1
    assert QueueRegistry(capacity=1).queue_for(deployment("d1", 0)).slots == 1


def test_full_queue_raises_resource_exhausted():
    async def scenario():
        queue = DeploymentQueue("d1", slots=1, policy=FcfsPolicy(capacity=1))
        running = entry("running")
        await queue.acquire(running)
        waiter = asyncio.create_task(queue.acquire(entry("waiting")))
        await settle()
        with pytest.raises(
            ResourceExhausted, match=r"queue of deployment d1 is full \(1 waiting\)"
        ):
            await queue.acquire(entry("rejected"))
        assert (queue.running, queue.waiting) == (1, 1)
        queue.release(running)
        await waiter
        assert (queue.running, queue.waiting) == (1, 0)

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_queue_and_takes_no_slot():
    async def scenario():
        queue = DeploymentQueue("d1", slots=1, policy=FcfsPolicy(capacity=10))
        running, later = entry("running"), entry("after")
        await queue.acquire(running)
        cancelled = asyncio.create_task(queue.acquire(entry("cancelled")))
        after = asyncio.create_task(queue.acquire(later))
        await settle()
        cancelled.cancel()
        await settle()
        assert cancelled.cancelled()
        assert (queue.running, queue.waiting) == (1, 1)
        queue.release(running)
        await after
        assert (queue.running, queue.waiting) == (1, 0)
        queue.release(later)
        assert (queue.running, queue.waiting) == (0, 0)

    asyncio.run(scenario())


def test_waiter_cancelled_just_after_admission_gives_its_slot_back():
    async def scenario():
        queue = DeploymentQueue("d1", slots=1, policy=FcfsPolicy(capacity=10))
        running = entry("running")
        await queue.acquire(running)
        unlucky = asyncio.create_task(queue.acquire(entry("unlucky")))
        nxt = asyncio.create_task(queue.acquire(entry("next")))
        await settle()
        queue.release(running)  # admits "unlucky": its slot is taken on its behalf...
        unlucky.cancel()  # ...and it is cancelled before it could run
        await settle()
        assert unlucky.cancelled()
        await nxt  # the slot went to the next waiter
        assert (queue.running, queue.waiting) == (1, 0)

    asyncio.run(scenario())


def test_release_without_acquire_is_an_error():
    queue = DeploymentQueue("d1", slots=1, policy=FcfsPolicy(capacity=1))
    with pytest.raises(RuntimeError, match="release without acquire"):
        queue.release(entry("never"))


def test_two_deployments_are_independent():
    async def scenario():
        registry = QueueRegistry(capacity=1)
        slow = registry.queue_for(deployment("slow", 1))
        fast = registry.queue_for(deployment("fast", 1))
        s1 = entry("s1")
        await slow.acquire(s1)
        blocked = asyncio.create_task(slow.acquire(entry("s2")))
        await settle()
        with pytest.raises(ResourceExhausted, match="slow"):
            await slow.acquire(entry("s3"))
        for i in range(3):  # slow's queue, full and busy, does not touch fast's
            async with fast.slot(entry(f"f{i}")):
                assert fast.running == 1
        assert (slow.waiting, slow.running) == (1, 1)
        assert (fast.waiting, fast.running) == (0, 0)
        blocked.cancel()
        await settle()
        slow.release(s1)

    asyncio.run(scenario())


def test_registry_follows_batch_size_and_prunes_idle_queues():
    async def scenario():
        registry = QueueRegistry(capacity=4)
        queue = registry.queue_for(deployment("d1", 1))
        a, b = entry("a"), entry("b")
        await queue.acquire(a)
        waiter = asyncio.create_task(queue.acquire(b))
        await settle()
        assert registry.queue_for(deployment("d1", 2)) is queue
        await waiter  # the new slot admits the waiter at once
        assert queue.running == 2
        registry.prune(keep=[])
        assert registry.get("d1") is queue  # busy queues stay
        queue.release(a)
        queue.release(b)
        registry.prune(keep=[])
        assert registry.get("d1") is None

    asyncio.run(scenario())


def test_edf_queue_rejects_requests_that_cannot_make_their_deadline():
    async def scenario():
        now = [0.0]
        queue = DeploymentQueue("d1", 1, EdfPolicy(capacity=4), clock=lambda: now[0])
        running = entry("running")
        await queue.acquire(running)
        late = asyncio.create_task(queue.acquire(entry("late", deadline_s=1.0)))
        await settle()
        now[0] = 2.0
        queue.release(running)
        with pytest.raises(DeadlineExceeded, match="late cannot meet its deadline"):
            await late
        assert (queue.running, queue.waiting) == (0, 0)

    asyncio.run(scenario())


def test_an_impossible_deadline_is_refused_at_once_with_predicted_and_allowed_times():
    async def scenario():
        clock = [100.0]
        queue = DeploymentQueue(
            "d1",
            slots=1,
            policy=EdfPolicy(capacity=10, prefill_s=lambda tokens: 0.002 * sum(tokens)),
            clock=lambda: clock[0],
        )
        hopeless = entry("late", deadline_s=100.1, prompt_tokens=100, objective="TTFT SLO 100 ms")
        hopeless.arrival_s = 100.0
        with pytest.raises(DeadlineExceeded) as refused:
            await queue.acquire(hopeless)  # 200 ms of prefill against 100 ms allowed
        message = str(refused.value)
        assert "first token predicted 200 ms after arrival, allowed 100 ms" in message
        assert "(TTFT SLO 100 ms)" in message
        assert "ask for fewer tokens" not in message
        assert (queue.running, queue.waiting) == (0, 0)  # nothing queued
        # A deadline whose predicted decode alone passes it leaves no time at all: said.
        decode_bound = entry(
            "long",
            deadline_s=99.8,
            prompt_tokens=1,
            max_tokens=51,
            objective="deadline_ms 300 ms less 500 ms",
        )
        decode_bound.arrival_s = 100.0
        decode_bound.unreachable = True
        # No queue could meet it: the request is to change (400, not a retried 504).
        with pytest.raises(DeadlineUnreachable) as refused:
            await queue.acquire(decode_bound)
        assert str(refused.value).endswith(
            "allowed -200 ms (deadline_ms 300 ms less 500 ms); the decode of max_tokens (51) "
            "alone takes longer than the deadline: ask for fewer tokens or a later deadline"
        )
        # Passed only by its decode beside the sequences running now: late, not
        # unreachable (decoded alone it would be on time; a retry may be).
        crowded = entry(
            "crowded", deadline_s=99.9, prompt_tokens=1, max_tokens=8, objective="deadline_ms"
        )
        crowded.arrival_s = 100.0
        with pytest.raises(DeadlineExceeded) as refused:
            await queue.acquire(crowded)
        assert not isinstance(refused.value, DeadlineUnreachable)
        assert str(refused.value).endswith(
            "the decode of max_tokens (8) beside the sequences running now takes longer than "
            "the deadline: ask for fewer tokens or a later deadline, or retry"
        )

    asyncio.run(scenario())


def test_a_waiting_request_is_refused_once_its_deadline_can_no_longer_be_met():
    async def scenario():
        clock = [0.0]
        queue = DeploymentQueue(
            "d1",
            slots=1,
            policy=EdfPolicy(capacity=10, prefill_s=lambda tokens: 0.1),
            clock=lambda: clock[0],
        )
        running = entry("running")
        await queue.acquire(running)
        waiting = asyncio.create_task(queue.acquire(entry("w", deadline_s=0.5)))
        await settle()
        assert queue.waiting == 1
        clock[0] = 0.45  # started now, its first token would come at 0.55 > 0.5
        queue.release(running)
        with pytest.raises(DeadlineExceeded, match="predicted 550 ms after arrival, allowed 500"):
            await waiting
        assert (queue.running, queue.waiting) == (0, 0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("scheduling", "policy"),
    [
        (common.SCHEDULING_POLICY_FCFS, FcfsPolicy),
        (common.SCHEDULING_POLICY_UNSPECIFIED, FcfsPolicy),
        (common.SCHEDULING_POLICY_EDF, EdfPolicy),
    ],
)
def test_each_deployment_gets_the_policy_its_objectives_name(scheduling, policy):
    registry = QueueRegistry(capacity=4)
    objectives = common.ServiceObjectives(scheduling=scheduling)
    queue = registry.queue_for(deployment("d1", 2, objectives=objectives))
    assert isinstance(queue._policy, policy)
    assert queue.predictor is not None


def test_edf_predicts_prefill_from_the_deployments_latency_model():
    registry = QueueRegistry(capacity=4)
    model = common.LatencyModel(prefill_fixed_ms=5, prefill_ms_per_token=1.0)
    objectives = common.ServiceObjectives(scheduling=common.SCHEDULING_POLICY_EDF)
    queue = registry.queue_for(
        deployment("d1", 1, objectives=objectives, latency_model=model, max_input_tokens=64)
    )
    queue._policy.push(entry("x", deadline_s=0.05, prompt_tokens=60))  # 65 ms > 50 ms
    assert [e.request_id for e in queue._policy.pop_ready(0.0, 1).dropped] == ["x"]


def test_edf_refuses_at_once_what_even_the_next_free_slot_comes_too_late_for():
    """Both slots run requests of 5.8 s: a 300 ms TTFT objective cannot be met
    whatever EDF puts first, and is refused when it arrives, not seconds later when a
    slot frees. A request whose deadline the next slot can make still waits."""

    async def scenario():
        clock = [10.0]
        predictor = LatencyPredictor(
            common.LatencyModel(prefill_ms_per_token=1.0), max_input_tokens=512, batch_size=2
        )
        queue = DeploymentQueue("d1", 2, EdfPolicy(capacity=4), clock=lambda: clock[0])
        queue.predictor = predictor
        a = entry("a")
        await queue.acquire(a)
        await queue.acquire(entry("b"))
        hopeless = entry("late", deadline_s=10.3, prompt_tokens=5, objective="TTFT SLO 300 ms")
        hopeless.arrival_s = 10.0
        # Nothing measured yet: nothing to predict with, so it waits.
        waiting = asyncio.create_task(queue.acquire(hopeless))
        await settle()
        assert queue.waiting == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

        predictor.mean_service_s = 5.8  # as measured
        with pytest.raises(DeadlineExceeded) as refused:
            await asyncio.wait_for(queue.acquire(hopeless), 2.0)  # at once, not queued
        # Both were admitted at 10.0 and hold their slots 5.8 s: the next frees at 15.8.
        assert "first token predicted 5805 ms after arrival, allowed 300 ms" in str(refused.value)
        assert (queue.running, queue.waiting) == (2, 0)
        patient = entry("patient", deadline_s=20.0, prompt_tokens=5)
        patient.arrival_s = 10.0
        queued = asyncio.create_task(queue.acquire(patient))
        await settle()
        assert queue.waiting == 1
        queue.release(a)
        await queued
        assert (queue.running, queue.waiting) == (2, 0)

    asyncio.run(scenario())


def measured_predictor(step_ms: float = 10.0) -> LatencyPredictor:
    """1 ms of prefill per prompt token, ``step_ms`` per decode step; a request has
    finished (refusals may use service times)."""
    predictor = LatencyPredictor(
        common.LatencyModel(prefill_ms_per_token=1.0, decode_step_ms=step_ms),
        max_input_tokens=512,
        batch_size=1,
    )
    predictor.mean_service_s = 5.0  # long requests came before
    return predictor


def edf_queue(clock: list[float], slots: int = 1) -> DeploymentQueue:
    predictor = measured_predictor()
    queue = DeploymentQueue(
        "d1", slots, EdfPolicy(capacity=8, prefill_s=predictor.prefill_s), lambda: clock[0]
    )
    queue.predictor = predictor
    return queue


def test_edf_predicts_requests_starting_together_to_wait_for_each_others_prefill():
    """Three slots free: three waiting requests start at once, and the worker prefills
    their prompts in one step, so the third's first token comes after all three
    (1 ms a token: 0.9 s), past its 0.8 s deadline; alone it would make it (0.3 s)."""

    async def scenario():
        clock = [0.0]
        queue = edf_queue(clock, slots=3)
        waiting = [entry(n, deadline_s=d, prompt_tokens=300) for n, d in (("p", 5.0), ("q", 5.0))]
        late = entry("late", deadline_s=0.8, prompt_tokens=300)
        assert queue._predicted_misses([*waiting, late]) == [late]
        assert late.predicted_first_token_s == pytest.approx(0.9)
        assert queue._predicted_misses([late]) == []

    asyncio.run(scenario())


def test_edf_counts_the_requests_queued_ahead_when_it_refuses_at_once():
    """One slot: the running request and two queued with earlier deadlines each hold it
    ~1 s (100 tokens of 10 ms), so a request due in 2.5 s cannot make it, though the
    running one alone would leave it time."""

    async def scenario():
        clock = [0.0]
        queue = edf_queue(clock)
        running = entry("running", max_tokens=100)
        await queue.acquire(running)
        ahead = [
            asyncio.create_task(queue.acquire(entry(n, deadline_s=d, max_tokens=100)))
            for n, d in (("x", 1.5), ("y", 2.2))
        ]
        await settle()
        late = entry("late", deadline_s=2.5, prompt_tokens=10, max_tokens=100)
        with pytest.raises(DeadlineExceeded, match="first token predicted 2980 ms"):
            await queue.acquire(late)
        assert (queue.running, queue.waiting) == (1, 2)
        for task in ahead:
            task.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)

    asyncio.run(scenario())


def test_edf_charges_a_running_request_its_own_length_not_the_mean():
    """The mean service time is 5 s (long requests came before), but the request running
    now asks for 4 tokens: a request due in 300 ms is admitted after it, not refused."""

    async def scenario():
        clock = [0.0]
        queue = edf_queue(clock)
        short = entry("short", max_tokens=4)
        await queue.acquire(short)
        soon = entry("soon", deadline_s=0.3, prompt_tokens=10, max_tokens=8)
        waiting = asyncio.create_task(queue.acquire(soon))
        await settle()
        assert queue.waiting == 1
        clock[0] = 0.04
        queue.release(short)
        await waiting
        assert queue.running == 1

    asyncio.run(scenario())


def test_a_waiting_request_is_refused_when_its_slot_is_predicted_to_come_too_late():
    """The check made at arrival runs again on what waits: once the running request is
    seen to run long (its own prediction, not the prefill alone), the next arrival's
    dispatch refuses the waiting request whose slot now comes too late."""

    async def scenario():
        clock = [0.0]
        queue = edf_queue(clock)
        running = entry("running", max_tokens=50)  # 0.49 s
        await queue.acquire(running)
        waiting = asyncio.create_task(
            queue.acquire(entry("w", deadline_s=1.0, prompt_tokens=10, max_tokens=10))
        )
        await settle()
        assert queue.waiting == 1
        # Another request queues ahead of it (earlier deadline, 0.59 s of service):
        # w's slot would now come at 1.08 s.
        first = asyncio.create_task(
            queue.acquire(entry("first", deadline_s=0.6, prompt_tokens=10, max_tokens=60))
        )
        with pytest.raises(DeadlineExceeded, match="w cannot meet its deadline"):
            await waiting
        assert queue.waiting == 1
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(scenario())


def test_a_waiting_request_is_refused_at_its_last_start_though_nothing_happens():
    """Nothing arrives or ends: the queue wakes at the waiting request's deadline less
    its prefill and refuses it then, not at the next arrival or release."""

    async def scenario():
        queue = DeploymentQueue(
            "d1", 1, EdfPolicy(capacity=4, prefill_s=lambda tokens: 0.05), time.perf_counter
        )
        running = entry("running")
        await queue.acquire(running)
        start = time.perf_counter()
        due = entry("due", deadline_s=start + 0.25)
        with pytest.raises(DeadlineExceeded, match="due cannot meet its deadline"):
            await asyncio.wait_for(queue.acquire(due), 5.0)
        assert time.perf_counter() - start < 2.0  # woken at about 0.2 s
        assert (queue.running, queue.waiting) == (1, 0)
        queue.release(running)

    asyncio.run(scenario())


def test_a_replica_that_stops_serving_sends_its_waiting_requests_away_at_once():
    """Removed (or taken out) while requests wait: they leave with QueueClosed once two
    prunes in a row leave the replica out (one alone may be a deployment created while
    the list was read), not when a slot frees on a worker that is draining or gone.
    The running request keeps its slot."""

    async def scenario():
        registry = QueueRegistry(capacity=4)
        queue = registry.queue_for(deployment("d1", 1))
        running = entry("running")
        await queue.acquire(running)
        waiting = asyncio.create_task(queue.acquire(entry("waiting")))
        await settle()
        registry.prune(keep=[])
        await settle()
        assert not waiting.done()
        registry.prune(keep=["d1"])  # serving again: the count starts over
        registry.prune(keep=[])
        await settle()
        assert not waiting.done()
        registry.prune(keep=[])
        with pytest.raises(QueueClosed, match="deployment d1 stopped serving"):
            await waiting
        assert (queue.running, queue.waiting) == (1, 0)
        assert registry.get("d1") is queue  # until its running request ends
        queue.release(running)
        registry.prune(keep=[])
        assert registry.get("d1") is None

    asyncio.run(scenario())


def test_an_idle_queue_that_refused_for_a_while_admits_one_predicted_late_to_measure():
    """Predictions too slow (learnt while the machine was busy, say) refuse every
    request with a deadline, and a refused request teaches nothing: an EDF deployment
    refused everything, idle, for as long as a tester watched. Idle and with nothing
    admitted for RELEARN_AFTER_S, a queue admits one such request; before that, and
    with anything running, it refuses as before."""

    async def scenario():
        clock = [0.0]
        queue = edf_queue(clock)  # 1 ms of prefill a token
        clock[0] = RELEARN_AFTER_S - 1
        with pytest.raises(DeadlineExceeded):
            await queue.acquire(entry("early", deadline_s=clock[0] + 0.1, prompt_tokens=300))
        clock[0] = RELEARN_AFTER_S + 1
        # One whose own decode passes its deadline is refused all the same: measuring
        # would not make it reachable (a tester got 1000 tokens for a 1 ms deadline).
        hopeless = entry("hopeless", deadline_s=clock[0] + 0.1, prompt_tokens=300)
        hopeless.unreachable = True
        with pytest.raises(DeadlineUnreachable):
            await queue.acquire(hopeless)
        assert queue.running == 0
        measured = entry("measured", deadline_s=clock[0] + 0.1, prompt_tokens=300)
        assert await queue.acquire(measured) is queue
        assert queue.running == 1
        # Admitted just now, and running: the next one predicted late is refused.
        with pytest.raises(DeadlineExceeded):
            await queue.acquire(entry("next", deadline_s=clock[0] + 0.1, prompt_tokens=300))
        queue.release(measured)
        clock[0] += 1
        with pytest.raises(DeadlineExceeded):
            await queue.acquire(entry("after", deadline_s=clock[0] + 0.1, prompt_tokens=300))

    asyncio.run(scenario())


def test_the_best_informed_replica_judges_for_its_deployment():
    """A deadline is judged by the replica that knows most (its requests, or the
    deployment's estimate): a replica that had measured nothing served what its sibling
    had just found hopeless (a tester)."""
    registry = QueueRegistry(capacity=4)
    estimated = deployment("est", 1, state=READY)
    estimated.latency_model.decode_step_ms = 20.0
    assert registry.best_informed(estimated).evidence > 0
    pair = deployment("pair", 1, state=READY)
    for index in (0, 1):
        pair.replicas.add(index=index, worker_address=f"w{index}", state=READY)
    assert not registry.best_informed(pair).evidence
    measured = registry.queue_for(pair, 1).predictor
    measured.observe(prompt_tokens=8, prompt_chars=32, first_token_s=0.05, tpot_s=0.02, running=1)
    assert registry.best_informed(pair) is measured
