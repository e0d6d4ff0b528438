"""``services.drain.InFlight``: counting calls, refusing new ones once draining, and
waiting (with a limit) for those in flight."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.drain import InFlight
from services.errors import Unavailable


class FakeContext:
    """Stands in for a ServicerContext: ``end`` runs the done callbacks, as gRPC does
    when the call ends."""

    def __init__(self) -> None:
        self.callbacks = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


def test_calls_are_counted_until_they_end():
    in_flight = InFlight("scheduler")
    first, second = FakeContext(), FakeContext()
    in_flight.admit(first)
    in_flight.admit(second)
    assert in_flight.count == 2
    first.end()
    assert in_flight.count == 1
    in_flight.enter()
    in_flight.leave()
    assert in_flight.count == 1 and not in_flight.draining


def test_a_drain_with_nothing_in_flight_returns_at_once():
    in_flight = InFlight("scheduler")
    assert asyncio.run(asyncio.wait_for(in_flight.drain(60.0), 1.0)) is True
    assert in_flight.draining


def test_new_calls_are_refused_with_unavailable_once_draining():
    in_flight = InFlight("scheduler")
    asyncio.run(in_flight.drain(1.0))
    context = FakeContext()
    with pytest.raises(Unavailable) as refused:
        in_flight.admit(context)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(refused.value).startswith("scheduler is draining: ")
    assert in_flight.count == 0 and context.callbacks == []  # nothing to leave later


def test_a_drain_waits_for_the_calls_in_flight():
    async def scenario() -> tuple[bool, float]:
        in_flight = InFlight("worker of deployment d1")
        context = FakeContext()
        in_flight.admit(context)
        loop = asyncio.get_running_loop()
        started = loop.time()
        loop.call_later(0.2, context.end)
        drained = await in_flight.drain(10.0)
        return drained, loop.time() - started

    drained, waited_s = asyncio.run(scenario())
    assert drained is True
    assert 0.15 <= waited_s < 5.0


def test_a_drain_gives_up_after_its_timeout():
    async def scenario() -> tuple[bool, float, int]:
        in_flight = InFlight("scheduler")
        in_flight.enter()
        loop = asyncio.get_running_loop()
        started = loop.time()
        drained = await in_flight.drain(0.2)
        return drained, loop.time() - started, in_flight.count

    drained, waited_s, count = asyncio.run(scenario())
    assert drained is False and count == 1
    assert 0.15 <= waited_s < 5.0
