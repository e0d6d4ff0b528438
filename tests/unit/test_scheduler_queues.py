"""DeploymentQueue and QueueRegistry on a real event loop (no server)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.policies import EdfPolicy, FcfsPolicy, QueueEntry
from scheduler_svc.queues import DeploymentQueue, QueueRegistry
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.errors import DeadlineExceeded, ResourceExhausted


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

        async def request(name: str, priority: bool = False):
            await queue.acquire(entry(name, priority))
            started.append(name)

        tasks = [asyncio.create_task(request(n)) for n in ("a", "b", "c", "d")]
        await settle()
        tasks.append(asyncio.create_task(request("p", priority=True)))
        await settle()
        assert started == ["a", "b"]
        assert (queue.running, queue.waiting) == (2, 3)
        queue.release()
        await settle()
        assert started == ["a", "b", "p"]
        queue.release()
        queue.release()
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
        await queue.acquire(entry("running"))
        waiter = asyncio.create_task(queue.acquire(entry("waiting")))
        await settle()
        with pytest.raises(
            ResourceExhausted, match=r"queue of deployment d1 is full \(1 waiting\)"
        ):
            await queue.acquire(entry("rejected"))
        assert (queue.running, queue.waiting) == (1, 1)
        queue.release()
        await waiter
        assert (queue.running, queue.waiting) == (1, 0)

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_queue_and_takes_no_slot():
    async def scenario():
        queue = DeploymentQueue("d1", slots=1, policy=FcfsPolicy(capacity=10))
        await queue.acquire(entry("running"))
        cancelled = asyncio.create_task(queue.acquire(entry("cancelled")))
        after = asyncio.create_task(queue.acquire(entry("after")))
        await settle()
        cancelled.cancel()
        await settle()
        assert cancelled.cancelled()
        assert (queue.running, queue.waiting) == (1, 1)
        queue.release()
        await after
        assert (queue.running, queue.waiting) == (1, 0)
        queue.release()
        assert (queue.running, queue.waiting) == (0, 0)

    asyncio.run(scenario())


def test_waiter_cancelled_just_after_admission_gives_its_slot_back():
    async def scenario():
        queue = DeploymentQueue("d1", slots=1, policy=FcfsPolicy(capacity=10))
        await queue.acquire(entry("running"))
        unlucky = asyncio.create_task(queue.acquire(entry("unlucky")))
        nxt = asyncio.create_task(queue.acquire(entry("next")))
        await settle()
        queue.release()  # admits "unlucky": its slot is taken on its behalf...
        unlucky.cancel()  # ...and it is cancelled before it could run
        await settle()
        assert unlucky.cancelled()
        await nxt  # the slot went to the next waiter
        assert (queue.running, queue.waiting) == (1, 0)

    asyncio.run(scenario())


def test_release_without_acquire_is_an_error():
    queue = DeploymentQueue("d1", slots=1, policy=FcfsPolicy(capacity=1))
    with pytest.raises(RuntimeError, match="release without acquire"):
        queue.release()


def test_two_deployments_are_independent():
    async def scenario():
        registry = QueueRegistry(capacity=1)
        slow = registry.queue_for(deployment("slow", 1))
        fast = registry.queue_for(deployment("fast", 1))
        await slow.acquire(entry("s1"))
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
        slow.release()

    asyncio.run(scenario())


def test_registry_follows_batch_size_and_prunes_idle_queues():
    async def scenario():
        registry = QueueRegistry(capacity=4)
        queue = registry.queue_for(deployment("d1", 1))
        await queue.acquire(entry("a"))
        waiter = asyncio.create_task(queue.acquire(entry("b")))
        await settle()
        assert registry.queue_for(deployment("d1", 2)) is queue
        await waiter  # the new slot admits the waiter at once
        assert queue.running == 2
        registry.prune(keep=[])
        assert registry.get("d1") is queue  # busy queues stay
        queue.release()
        queue.release()
        registry.prune(keep=[])
        assert registry.get("d1") is None

    asyncio.run(scenario())


def test_edf_queue_rejects_requests_that_cannot_make_their_deadline():
    async def scenario():
        now = [0.0]
        queue = DeploymentQueue("d1", 1, EdfPolicy(capacity=4), clock=lambda: now[0])
        await queue.acquire(entry("running"))
        late = asyncio.create_task(queue.acquire(entry("late", deadline_s=1.0)))
        await settle()
        now[0] = 2.0
        queue.release()
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
        assert (queue.running, queue.waiting) == (0, 0)  # nothing queued

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
        await queue.acquire(entry("running"))
        waiting = asyncio.create_task(queue.acquire(entry("w", deadline_s=0.5)))
        await settle()
        assert queue.waiting == 1
        clock[0] = 0.45  # started now, its first token would come at 0.55 > 0.5
        queue.release()
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
    """Both slots run requests of about 5.8 s: a 300 ms TTFT objective cannot be met
    whatever EDF puts first, and is refused when it arrives, not seconds later when a
    slot frees. A request whose deadline the next slot can make still waits."""
    from scheduler_svc.predictor import LatencyPredictor

    async def scenario():
        clock = [10.0]
        predictor = LatencyPredictor(
            common.LatencyModel(prefill_ms_per_token=1.0), max_input_tokens=512, batch_size=2
        )
        queue = DeploymentQueue("d1", 2, EdfPolicy(capacity=4), clock=lambda: clock[0])
        queue.predictor = predictor
        await queue.acquire(entry("a"))
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
        assert "first token predicted 2905 ms after arrival, allowed 300 ms" in str(refused.value)
        assert (queue.running, queue.waiting) == (2, 0)
        patient = entry("patient", deadline_s=20.0, prompt_tokens=5)
        patient.arrival_s = 10.0
        queued = asyncio.create_task(queue.acquire(patient))
        await settle()
        assert queue.waiting == 1
        queue.release()
        await queued
        assert (queue.running, queue.waiting) == (2, 0)

    asyncio.run(scenario())
