"""Drives the engine's batch core from one engine thread and streams tokens to asyncio.

One thread owns the engine's BatchEngine. A request arrives from the event loop through
a deque (appends and pops are atomic) and joins the core's queue at the next step
boundary; the core admits queued requests into free KV-cache slots first in, first out,
so while all ``max_batch`` slots are busy a request waits for the first slot that a
finishing or cancelled sequence gives back. A request whose ``stop`` event is set (its
gRPC call was cancelled) is cancelled in the core at the next boundary, freeing its slot.

Tokens travel back with ``loop.call_soon_threadsafe``: one call per engine step carries
every token of that step to its request's own asyncio.Queue; no per-token locks or
futures, because this sits on the latency-critical path.

Busy time: the engine thread records each step's (start, end) ``time.perf_counter``
interval in a :class:`BusyLog` (a bounded deque, back-to-back steps merged), from which
``busy_seconds`` (total since start) and the busy share of a recent window come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from monitor_agent.engine.batching import GenerationRequest, SequenceHandle, SequenceState
from monitor_agent.engine.engine import Engine, SamplingConfig, StepOutput
from services.stop_strings import StopScanner

log = logging.getLogger("iserve.worker")

# Steps that start within this many seconds of the previous one's end extend its interval.
BUSY_MERGE_GAP_S = 1e-3
BUSY_MAX_INTERVALS = 4096


@dataclass
class RequestClock:
    """Timestamps (``time.perf_counter`` seconds) of one request inside the worker."""

    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    # Prompt tokens prefilled in the engine step that admitted it, its own included
    # (SequenceHandle.prefilled_with); 0 where the engine does not say.
    prefilled_with: int = 0
    # Seconds its text prompt waited for the worker's encoding thread, behind others.
    prompt_wait_s: float = 0.0
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


class BusyLog:
    """Intervals (perf_counter seconds) the engine spent stepping; the oldest are dropped
    beyond ``max_intervals``, but ``total_seconds`` counts every one."""

    def __init__(self, max_intervals: int = BUSY_MAX_INTERVALS) -> None:
        self.intervals: deque[tuple[float, float]] = deque(maxlen=max_intervals)
        self.total_seconds = 0.0

    def record(self, start: float, end: float) -> None:
        self.total_seconds += end - start
        if self.intervals and start - self.intervals[-1][1] <= BUSY_MERGE_GAP_S:
            self.intervals[-1] = (self.intervals[-1][0], end)
        else:
            self.intervals.append((start, end))

    def busy_fraction(self, window_s: float, now: float | None = None) -> float:
        """Share (0..1) of the last ``window_s`` seconds before ``now`` spent stepping."""
        now = time.perf_counter() if now is None else now
        since = now - window_s
        busy = sum(
            min(end, now) - max(start, since)
            for start, end in self.intervals
            if end > since and start < now
        )
        return busy / window_s


@dataclass(frozen=True)
class _Finished:
    """Queue sentinel: the engine let go of the request, with ``error`` when it failed."""

    error: BaseException | None = None


_DONE = _Finished()


@dataclass(eq=False)
class _Job:
    """One request between the event loop and the engine thread."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput | _Finished]
    stop: threading.Event
    clock: RequestClock
    # Its stop strings' scanner (engine thread only); None without stop strings.
    stops: StopScanner | None = None


class EngineRunner:
    """Owns the engine; the asyncio side of the worker talks to it only through here."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._core = engine.batch
        self._arrivals: deque[_Job] = deque()
        self._wake = threading.Event()
        self._closed = False
        self.busy = BusyLog()
        # Written only by the engine thread; read by the event loop for GetWorkerStats.
        self.requests_served = 0
        self.tokens_generated = 0
        # Written only by the event loop: requests waiting for or holding a slot.
        self.active_requests = 0
        # Owned by the engine thread: the jobs the core holds, waiting or running.
        self._jobs: dict[SequenceHandle, _Job] = {}
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()

    @property
    def busy_seconds(self) -> float:
        """Seconds the engine has spent stepping since it started."""
        return self.busy.total_seconds

    def parse(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingConfig,
        max_tokens_is_bound: bool = False,
    ) -> GenerationRequest:
        """The engine's request for these values; ValueError, saying what to fix, for
        one the engine cannot run. With ``max_tokens_is_bound`` (the client set none),
        max_tokens is cut to what the sequence leaves after the prompt; a prompt that
        leaves nothing is still refused."""
        room = self._core.max_seq_len - len(prompt_ids)
        if max_tokens_is_bound:
            if room < 1:  # named without the max_tokens the client never sent
                raise ValueError(
                    f"prompt ({len(prompt_ids)} tokens) leaves no room to generate in the "
                    f"{self._core.max_seq_len} positions this deployment holds per sequence"
                )
            max_tokens = min(max_tokens, room)
        request = GenerationRequest(tuple(prompt_ids), max_tokens, sampling)
        self._core.validate(request)
        return request

    async def generate(
        self, request: GenerationRequest, stop: threading.Event, clock: RequestClock
    ) -> AsyncIterator[StepOutput]:
        """Stream the engine's StepOutputs for one request (from :meth:`parse`).

        Setting ``stop`` (or closing this generator) ends the generation at the engine's
        next step boundary; the request's slot is free again once this generator has
        finished. An engine failure during the request propagates unchanged.
        """
        self.active_requests += 1
        try:
            if stop.is_set():
                return
            queue: asyncio.Queue[StepOutput | _Finished] = asyncio.Queue()
            self._arrivals.append(_Job(request, asyncio.get_running_loop(), queue, stop, clock))
            self._wake.set()
            released = False
            try:
                while True:
                    item = await queue.get()
                    if type(item) is _Finished:
                        released = True
                        if item.error is not None:
                            raise item.error
                        return
                    yield item
            finally:
                if not released:
                    stop.set()
                    # Return once the engine has let go of the request, so its slot is free
                    # and it is counted; a second cancellation only skips the wait.
                    with contextlib.suppress(asyncio.CancelledError):
                        while type(await queue.get()) is not _Finished:
                            pass
        finally:
            self.active_requests -= 1

    def close(self) -> None:
        """Stop the engine thread after its current step; the requests it holds end
        without a final token. Call once nothing submits any more (the server stopped)."""
        self._closed = True
        self._wake.set()

    def _serve(self) -> None:
        """Engine thread: take arrivals and cancellations at each boundary, then step."""
        while not self._closed:
            self._take_arrivals()
            self._drop_stopped()
            if not self._jobs:
                self._wake.wait()
                self._wake.clear()
                continue
            self._step()
        for handle in list(self._jobs):
            self._core.cancel(handle)
            self._release(self._jobs.pop(handle), _DONE)
        while self._arrivals:
            self._release(self._arrivals.popleft(), _DONE)

    def _take_arrivals(self) -> None:
        while self._arrivals:
            job = self._arrivals.popleft()
            if job.stop.is_set():
                self._release(job, _DONE)
                continue
            if job.request.sampling.stop_strings:
                job.stops = StopScanner(job.request.sampling.stop_strings)
            self._jobs[self._core.submit(job.request)] = job

    def _drop_stopped(self) -> None:
        stopped = [handle for handle, job in self._jobs.items() if job.stop.is_set()]
        for handle in stopped:
            if handle.state is SequenceState.RUNNING:
                self.requests_served += 1
            self._core.cancel(handle)
            self._release(self._jobs.pop(handle), _DONE)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self._core.step()
        except Exception as exc:  # noqa: BLE001 - handed to the requests that were in it
            self.busy.record(started, time.perf_counter())
            log.exception("engine step failed")
            self._fail_admitted(exc)
            return
        self.busy.record(started, time.perf_counter())
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[Callable, object]]] = {}
        for handle, output in outputs:
            job = self._jobs.get(handle)
            if job is None:
                continue  # a stop string ended it earlier in this step's outputs
            if job.clock.admitted is None:
                job.clock.admitted = handle.admitted_at
                job.clock.prefilled_with = handle.prefilled_with
            if output.error is not None:  # this request failed alone; its slot is free
                del self._jobs[handle]
                self.requests_served += 1
                deliveries.setdefault(job.loop, []).append(
                    (job.queue.put_nowait, _Finished(output.error))
                )
                continue
            if job.stops is not None:
                output = self._cut_at_stop(handle, job.stops, output)
            batch = deliveries.setdefault(job.loop, [])
            batch.append((job.queue.put_nowait, output))
            self.tokens_generated += 1
            if output.finished:
                del self._jobs[handle]
                batch.append((job.queue.put_nowait, _DONE))
                self.requests_served += 1
        for loop, batch in deliveries.items():
            with contextlib.suppress(RuntimeError):  # the loop closed under us: nobody listens
                loop.call_soon_threadsafe(_deliver, batch)

    def _cut_at_stop(
        self, handle: SequenceHandle, stops: StopScanner, output: StepOutput
    ) -> StepOutput:
        """``output`` with its text cut at the request's first stop string, which ends the
        generation (finish reason "stop"; the core lets go of it now, freeing its slot);
        text that could still begin one is held back until the next token, or the end."""
        text = stops.feed(output.text)
        if stops.stopped:
            if not output.finished:
                self._core.cancel(handle)
            return StepOutput(output.token_id, text, True, "stop")
        if output.finished:
            text += stops.flush()
        return StepOutput(output.token_id, text, output.finished, output.finish_reason)

    def _fail_admitted(self, error: BaseException) -> None:
        """After a failed step, end every request that had a slot; queued ones stay."""
        failed = [h for h in self._jobs if h.state is not SequenceState.WAITING]
        for handle in failed:
            self.requests_served += 1
            self._core.cancel(handle)
            self._release(self._jobs.pop(handle), _Finished(error))

    def _release(self, job: _Job, finished: _Finished) -> None:
        """Tell the job's generator that the engine is done with it."""
        with contextlib.suppress(RuntimeError):
            job.loop.call_soon_threadsafe(job.queue.put_nowait, finished)


def _deliver(batch: list[tuple[Callable, object]]) -> None:
    for put, item in batch:
        put(item)
