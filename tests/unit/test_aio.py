"""services.aio.cancel_and_wait: a task that lost a cancellation (as Python 3.11's
asyncio.wait_for can lose one, gh-86296) is cancelled again until it ends."""

from __future__ import annotations

import asyncio

from services.aio import cancel_and_wait


def test_a_task_that_swallows_cancellations_is_cancelled_until_it_ends():
    async def scenario():
        swallowed = 0

        async def stubborn():
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    # What 3.11's wait_for does when the call it waits for has just
                    # completed: the cancellation is gone.
                    if swallowed == 3:
                        raise
                    swallowed += 1

        async def fails():
            raise ValueError("its outcome is not wanted")

        ordinary = asyncio.ensure_future(asyncio.sleep(10))
        tasks = [asyncio.ensure_future(stubborn()), ordinary, asyncio.ensure_future(fails())]
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait(tasks, recancel_after_s=0.01), 5)
        assert all(task.done() for task in tasks)
        assert swallowed == 3 and tasks[0].cancelled() and ordinary.cancelled()
        assert isinstance(tasks[2].exception(), ValueError)

    asyncio.run(scenario())


def test_nothing_to_cancel_returns_at_once():
    async def scenario():
        done = asyncio.ensure_future(asyncio.sleep(0, result=7))
        await done
        await asyncio.wait_for(cancel_and_wait([done]), 1)
        await asyncio.wait_for(cancel_and_wait([]), 1)
        assert done.result() == 7

    asyncio.run(scenario())
