"""Which replica a request joins: QueueRegistry.shortest_wait, choose_replica and
DeploymentQueue.expected_wait_s on a real event loop (no server)."""

from __future__ import annotations

import asyncio
import math

import pytest

from scheduler_svc.policies import QueueEntry
from scheduler_svc.queues import QueueRegistry
from services import replicas
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.errors import ResourceExhausted

READY = deploy_pb.DEPLOYMENT_STATE_READY
# 1 ms per prompt token, so queued prompt work is visible in the expected wait.
LATENCY = common.LatencyModel(prefill_fixed_ms=0.0, prefill_ms_per_token=1.0, decode_step_ms=5.0)


def deployment(count: int = 2, batch_size: int = 1) -> deploy_pb.Deployment:
    dep = deploy_pb.Deployment(
        deployment_id="m-0a1b2c3d",
        state=READY,
        config=common.DeploymentConfig(batch_size=batch_size),
        max_input_tokens=512,
        latency_model=LATENCY,
    )
    for i in range(count):
        dep.replicas.add(index=i, worker_address=f"127.0.0.1:{5000 + i}", state=READY)
    return dep


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class ManualClock:
    """A clock that moves only when told: waits computed from it are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Load:
    """Requests held on replicas' queues: running ones hold a slot, the rest wait."""

    def __init__(self, registry: QueueRegistry, dep: deploy_pb.Deployment):
        self.registry, self.dep = registry, dep
        self.tasks: list[asyncio.Task] = []

    async def add(self, replica: int, prompt_tokens: int = 1, max_tokens: int = 0) -> None:
        queue = self.registry.queue_for(self.dep, replica)
        entry = QueueEntry(
            f"r{replica}-{len(self.tasks)}",
            0.0,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )
        self.tasks.append(asyncio.create_task(queue.acquire(entry)))
        await settle()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def scenario(body):
    async def main():
        registry = QueueRegistry(capacity=8, clock=ManualClock())
        dep = deployment()
        load = Load(registry, dep)
        try:
            await body(registry, dep, load)
        finally:
            await load.close()

    asyncio.run(main())


def test_idle_replicas_tie_and_the_lowest_index_wins():
    async def body(registry, dep, load):
        assert registry.shortest_wait(dep) == (0.0, 0)

    scenario(body)


def test_idle_replicas_take_requests_that_come_one_at_a_time_in_turn():
    """Each request finishes before the next comes: every wait ties at zero, and the
    replica chosen least recently takes the next (the lowest index took them all, and
    the other's predictor never measured a request)."""

    async def body(registry, dep, load):
        chosen = [registry.choose_replica(dep) for _ in range(5)]
        assert chosen == [0, 1, 0, 1, 0]
        # Work waiting on a replica still outweighs taking turns.
        await load.add(0)
        assert [registry.choose_replica(dep) for _ in range(2)] == [1, 1]

    scenario(body)


def test_each_replica_has_its_own_queue_named_by_its_group_id():
    async def body(registry, dep, load):
        await load.add(1)
        assert registry.get("m-0a1b2c3d.r1").running == 1
        assert registry.get("m-0a1b2c3d") is None  # replica 0 has had no request

    scenario(body)


def test_a_busy_replica_loses_to_an_idle_one_before_any_service_time_is_known():
    async def body(registry, dep, load):
        await load.add(0)
        # Nothing is known yet of how long a request runs: still, the idle replica wins,
        # so concurrent requests spread over the replicas.
        assert registry.shortest_wait(dep) == (0.0, 1)
        await load.add(1)
        assert registry.shortest_wait(dep)[1] == 0  # 1 and 1: the lowest index

    scenario(body)


def test_running_work_without_max_tokens_counts_the_mean_service_time():
    async def body(registry, dep, load):
        registry.queue_for(dep, 0).predictor.mean_service_s = 1.0
        registry.queue_for(dep, 1).predictor.mean_service_s = 4.0
        await load.add(0)
        await load.add(1)
        # One slot each, busy: a new request waits for the running one to end.
        assert registry.queue_for(dep, 0).expected_wait_s() == pytest.approx(1.0)
        assert registry.queue_for(dep, 1).expected_wait_s() == pytest.approx(4.0)
        assert registry.shortest_wait(dep) == (pytest.approx(1.0), 0)
        await load.add(0)
        await load.add(0)  # two waiting behind the running one: 3 s ahead
        assert registry.shortest_wait(dep) == (pytest.approx(3.0), 0)
        await load.add(0)  # 4 s ahead, as on the slower replica: the fewer requests win
        assert registry.shortest_wait(dep) == (pytest.approx(4.0), 1)
        await load.add(0)
        assert registry.shortest_wait(dep) == (pytest.approx(4.0), 1)

    scenario(body)


def test_each_request_is_priced_by_its_own_prompt_and_max_tokens():
    """A request holds its slot for its prefill and a decode step per token after the
    first: 1 ms a prompt token, 5 ms a step (LATENCY)."""

    async def body(registry, dep, load):
        await load.add(0, prompt_tokens=10, max_tokens=101)  # running: 0.01 + 0.5 s
        await load.add(0, prompt_tokens=400, max_tokens=1)  # waiting: 0.4 s
        await load.add(1, prompt_tokens=10, max_tokens=21)  # running: 0.01 + 0.1 s
        await load.add(1, prompt_tokens=10, max_tokens=21)  # waiting: 0.11 s
        wait0 = registry.queue_for(dep, 0).expected_wait_s()
        wait1 = registry.queue_for(dep, 1).expected_wait_s()
        assert wait0 == pytest.approx(0.51 + 0.4)
        assert wait1 == pytest.approx(0.11 + 0.11)
        assert registry.shortest_wait(dep) == (pytest.approx(wait1), 1)

    scenario(body)


def test_a_replica_whose_first_request_was_short_is_not_taken_for_a_fast_one():
    """Replica 0 finished one 4-token request; replica 1 none, and another deployment of
    the model is slow. Six 64-token requests split 3 / 3: priced by their max_tokens
    under the predictor that knows most, not by replica 0's short mean against the
    model's slowest (replica 0 took five of six while replica 1 idled)."""

    async def main():
        registry = QueueRegistry(capacity=8, clock=ManualClock())
        dep, other = deployment(), deployment(count=1)
        other.deployment_id = "m-slow"
        load, slow = Load(registry, dep), Load(registry, other)
        try:
            registry.queue_for(other, 0).predictor.mean_service_s = 5.0
            await slow.add(0)
            first = registry.queue_for(dep, 0).predictor
            first.observe(
                prompt_tokens=4,
                prompt_chars=16,
                first_token_s=0.004,
                tpot_s=0.005,
                running=1,
                service_s=0.02,
                output_share=1.0,
            )
            chosen = []
            for _ in range(6):
                _, index = registry.shortest_wait(dep)
                chosen.append(index)
                await load.add(index, prompt_tokens=4, max_tokens=64)
            assert sorted(chosen) == [0, 0, 0, 1, 1, 1], chosen
        finally:
            await load.close()
            await slow.close()

    asyncio.run(main())


def test_free_slots_mean_no_wait_for_running_work():
    async def main():
        registry = QueueRegistry(capacity=8, clock=ManualClock())
        dep = deployment(count=1, batch_size=4)
        load = Load(registry, dep)
        registry.queue_for(dep, 0).predictor.mean_service_s = 2.0
        for _ in range(3):
            await load.add(0)
        assert registry.queue_for(dep, 0).expected_wait_s() == 0.0  # a fourth slot is free
        await load.add(0)
        # Four running on four slots since the same moment: the first to end frees one.
        assert registry.queue_for(dep, 0).expected_wait_s() == pytest.approx(2.0)
        await load.close()

    asyncio.run(main())


def test_a_replica_taken_out_gets_no_requests():
    async def body(registry, dep, load):
        await load.add(1)
        await load.add(1)
        assert replicas.take_out(dep, 0, "worker gone")
        assert registry.shortest_wait(dep)[1] == 1

    scenario(body)


def test_no_serving_replica_is_an_infinite_wait():
    dep = deployment()
    dep.state = deploy_pb.DEPLOYMENT_STATE_FAILED
    wait_s, index = QueueRegistry(capacity=1).shortest_wait(dep)
    assert math.isinf(wait_s) and index == 0


def test_a_record_without_replicas_routes_to_its_one_worker():
    dep = deployment(count=0)
    assert QueueRegistry(capacity=1).shortest_wait(dep) == (0.0, 0)


def test_a_copy_with_nothing_finished_is_charged_the_slowest_measured_service_time():
    """Replica 1 is fresh (no request finished): its queue of six is not free work. It
    was charged a millisecond a request, and took every request while replica 0 idled."""

    async def body(registry, dep, load):
        registry.queue_for(dep, 0).predictor.mean_service_s = 2.0
        await load.add(0)  # replica 0: one running, 2 s to a free slot
        for _ in range(6):
            await load.add(1)  # replica 1: one running, five waiting, nothing measured
        assert not registry.queue_for(dep, 1).predictor.service_measured
        wait_s, index = registry.shortest_wait(dep)
        assert index == 0 and wait_s == pytest.approx(2.0)

    scenario(body)


def test_a_full_queue_is_not_chosen_while_another_copy_has_room():
    async def main():
        registry = QueueRegistry(capacity=2, clock=ManualClock())
        dep = deployment()
        load = Load(registry, dep)
        try:
            for queue in (registry.queue_for(dep, 0), registry.queue_for(dep, 1)):
                queue.predictor.mean_service_s = 1.0
            for _ in range(3):
                await load.add(0)  # one running, two waiting: full
            registry.queue_for(dep, 1).predictor.mean_service_s = 100.0  # slow, but room
            await load.add(1)
            assert registry.shortest_wait(dep) == (pytest.approx(100.0), 1)
            for _ in range(2):
                await load.add(1)  # both full: nowhere to go
            assert registry.shortest_wait(dep)[0] == math.inf
        finally:
            await load.close()

    asyncio.run(main())


@pytest.mark.parametrize("edf", [False, True])
def test_a_replica_that_frees_first_takes_the_requests_waiting_on_another(edf):
    """Requests routed to a replica by its predicted wait stayed there when another
    replica freed first (its requests ended early) and idled: a replica with a slot free
    and nothing of its own waiting admits the next request waiting on its siblings, in
    that queue's order, and acquire says which replica holds it."""

    async def main():
        registry = QueueRegistry(capacity=8, clock=ManualClock())
        dep = deployment()
        if edf:
            dep.objectives.scheduling = common.SCHEDULING_POLICY_EDF
        first, second = registry.queue_for(dep, 0), registry.queue_for(dep, 1)
        registry.set_serving(dep)
        held = {name: QueueEntry(name, 0.0, prompt_tokens=1) for name in ("a", "b", "w1", "w2")}
        assert await first.acquire(held["a"]) is first
        assert await second.acquire(held["b"]) is second
        w1 = asyncio.create_task(first.acquire(held["w1"]))
        w2 = asyncio.create_task(first.acquire(held["w2"]))
        await settle()
        assert (first.waiting, second.waiting) == (2, 0)

        second.release(held["b"])  # the second replica frees first
        assert await asyncio.wait_for(w1, 5) is second  # the first in line moves, says where
        assert (first.waiting, first.running, second.running) == (1, 1, 1)
        first.release(held["a"])
        assert await asyncio.wait_for(w2, 5) is first
        # A replica taken out (closed) takes nothing; slots go back where they are held.
        second.close()
        second.release(held["w1"])
        late = asyncio.create_task(first.acquire(QueueEntry("late", 0.0, prompt_tokens=1)))
        await settle()
        assert first.waiting == 1 and second.running == 0
        first.release(held["w2"])
        assert await asyncio.wait_for(late, 5) is first

    asyncio.run(main())


def test_a_replica_that_does_not_serve_takes_no_waiting_request():
    """A replica restarting (not READY in the records) or whose worker the scheduler
    found gone took the request waiting on another each time it freed; the scheduler
    then sent it back, and the queue took it again (a RecursionError under load)."""

    async def main():
        registry = QueueRegistry(capacity=8, clock=ManualClock())
        dep = deployment()
        first, second = registry.queue_for(dep, 0), registry.queue_for(dep, 1)
        dep.replicas[1].state = deploy_pb.DEPLOYMENT_STATE_STARTING  # restarting
        registry.set_serving(dep)
        a, b = QueueEntry("a", 0.0), QueueEntry("b", 0.0)
        await first.acquire(a)
        await second.acquire(b)
        waiting = asyncio.create_task(first.acquire(QueueEntry("w", 0.0)))
        await settle()
        second.release(b)
        await settle()
        assert not waiting.done() and first.waiting == 1 and second.running == 0
        dep.replicas[1].state = READY  # back: it takes the next one that waits
        registry.set_serving(dep)
        await second.acquire(b)
        second.release(b)
        assert await asyncio.wait_for(waiting, 5) is second

    asyncio.run(main())


def test_a_replicas_refusal_names_the_deployment_a_client_knows():
    """Refusals said "deployment m-0a1b2c3d.r1", a worker group id no client knows."""
    registry = QueueRegistry(capacity=8, clock=ManualClock())
    dep = deployment()
    assert registry.queue_for(dep, 1).described == "deployment m-0a1b2c3d (replica 1)"
    assert registry.queue_for(dep, 0).described == "deployment m-0a1b2c3d"


def test_a_replica_back_in_service_takes_the_waiting_requests_without_an_arrival():
    """A replica restarted after its worker died had no arrival or release of its own:
    it idled while its sibling's queue drained one request at a time, until a new
    request came. The scheduler's refresh (serving_now) sets it to work; a queue closed
    while its replica was out opens again."""

    async def main():
        registry = QueueRegistry(capacity=8, clock=ManualClock())
        dep = deployment()
        first, second = registry.queue_for(dep, 0), registry.queue_for(dep, 1)
        out = deploy_pb.Deployment()
        out.CopyFrom(dep)
        out.replicas[1].state = deploy_pb.DEPLOYMENT_STATE_STARTING  # restarting
        registry.serving_now(out)
        second.close()  # the scheduler closed its queue while it was out
        await first.acquire(QueueEntry("a", 0.0))
        waiting = [asyncio.create_task(first.acquire(QueueEntry(w, 0.0))) for w in "xyz"]
        await settle()
        assert (first.waiting, second.running) == (3, 0)
        registry.serving_now(out)  # still out: nothing moves
        await settle()
        assert first.waiting == 3
        registry.serving_now(dep)  # back in the records
        assert registry.queue_for(dep, 1) is second and not second.closed
        assert await asyncio.wait_for(waiting[0], 5) is second  # with no arrival
        assert (first.waiting, second.running) == (2, 1)
        for task in waiting[1:]:
            task.cancel()
        await asyncio.gather(*waiting[1:], return_exceptions=True)

    asyncio.run(main())


def test_the_queue_capacity_is_the_deployments_whatever_its_replicas():
    """ISERVE_QUEUE_CAPACITY is waiting requests per deployment; with 2 replicas each
    queue held that many, so twice as many waited, and the refusal still said 64."""

    async def main():
        registry = QueueRegistry(capacity=3, clock=ManualClock())
        dep = deployment()
        load = Load(registry, dep)
        try:
            for replica in (0, 1):
                await load.add(replica)  # running
            registry.check_room(dep)
            for replica in (0, 1, 0):
                await load.add(replica)  # 3 waiting in all
            with pytest.raises(ResourceExhausted) as full:
                registry.check_room(dep)
            assert str(full.value) == (
                "queue of deployment m-0a1b2c3d is full (3 waiting on its 2 replicas)"
            )
            assert registry.waiting_on(dep) == 3
            # A replica FAILED: the message counts those that serve (a probe).
            dep.replicas[1].state = deploy_pb.DEPLOYMENT_STATE_FAILED
            with pytest.raises(ResourceExhausted) as full:
                registry.check_room(dep)
            assert str(full.value) == (
                "queue of deployment m-0a1b2c3d is full (3 waiting on 1 of its 2 replicas serving)"
            )
            registry.check_room(deployment(count=1))  # one replica: its queue's own limit
        finally:
            await load.close()

    asyncio.run(main())
