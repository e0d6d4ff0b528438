"""Runs the engine's synchronous token generator in a thread and streams it to asyncio.

The engine thread hands each StepOutput to the event loop with one
``loop.call_soon_threadsafe(queue.put_nowait, step)``: no per-token locks, futures or
allocations beyond the step itself, because this sits on the latency-critical path.
One generation runs at a time (an asyncio lock admits requests in arrival order and a
single-thread executor serialises engine calls even if a cancelled request's thread is
still finishing its step); batching across ``max_batch`` slots comes later.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from monitor_agent.engine.engine import Engine, SamplingConfig, StepOutput


@dataclass
class RequestClock:
    """Timestamps (``time.perf_counter`` seconds) of one request inside the worker."""

    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def token(self) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += 1

    @property
    def queue_ms(self) -> float:
        return 0.0 if self.admitted is None else (self.admitted - self.arrived) * 1e3

    @property
    def ttft_ms(self) -> float:
        return 0.0 if self.first_token is None else (self.first_token - self.arrived) * 1e3

    @property
    def tpot_ms(self) -> float:
        """Mean time between tokens after the first (0 with fewer than two tokens)."""
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return 0.0
        return (self.last_token - self.first_token) * 1e3 / (self.tokens - 1)

    def total_ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1e3


@dataclass(frozen=True)
class _Finished:
    """Queue sentinel: the engine generator ended, with ``error`` when it raised."""

    error: BaseException | None = None


class EngineRunner:
    """Owns the engine; the asyncio side of the worker talks to it only through here."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._admission = asyncio.Lock()
        # Written only by the engine thread; read by the event loop for GetWorkerStats.
        self.requests_served = 0
        self.tokens_generated = 0
        self.busy_seconds = 0.0
        # Written only by the event loop: requests waiting for or holding the engine.
        self.active_requests = 0

    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingConfig,
        stop: threading.Event,
        clock: RequestClock,
    ) -> AsyncIterator[StepOutput]:
        """Stream the engine's StepOutputs for one request.

        Setting ``stop`` (or closing this generator) ends the generation at the engine's
        next step; the engine is free again once this generator has finished. Errors the
        engine raises (ValueError for bad input) propagate unchanged.
        """
        self.active_requests += 1
        try:
            async with self._admission:
                clock.admitted = time.perf_counter()
                if stop.is_set():
                    return
                loop = asyncio.get_running_loop()
                queue: asyncio.Queue[StepOutput | _Finished] = asyncio.Queue()
                job = loop.run_in_executor(
                    self._executor, self._run, loop, queue, prompt_ids, max_tokens, sampling, stop
                )
                try:
                    while True:
                        item = await queue.get()
                        if type(item) is _Finished:
                            if item.error is not None:
                                raise item.error
                            return
                        yield item
                finally:
                    stop.set()
                    # Hold admission until the engine has really stopped; a second
                    # cancellation only skips the wait (the executor still serialises).
                    with contextlib.suppress(asyncio.CancelledError):
                        await job
        finally:
            self.active_requests -= 1

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingConfig,
        stop: threading.Event,
    ) -> None:
        """Engine thread: drive the generator, posting every step to the event loop."""
        post = loop.call_soon_threadsafe
        put = queue.put_nowait
        started = time.perf_counter()
        tokens = 0
        finished = _Finished()
        try:
            for step in self.engine.generate(prompt_ids, max_tokens, sampling, stop.is_set):
                tokens += 1
                post(put, step)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who raises it
            finished = _Finished(exc)
        finally:
            self.busy_seconds += time.perf_counter() - started
            self.tokens_generated += tokens
            self.requests_served += 1
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nobody listens
            post(put, finished)

    def close(self) -> None:
        """Stop accepting engine work; a running step finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)
