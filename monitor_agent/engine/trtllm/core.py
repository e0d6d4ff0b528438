"""The core the worker's EngineRunner drives, over TensorRT-LLM's own batching.

TensorRT-LLM batches on its own (in-flight batching in its executor), so this core does
not step a model: ``submit`` starts ``llm.generate_async(prompt_ids, params,
streaming=True)`` on a private asyncio loop thread, each streamed ``RequestOutput`` (the
same object, its ``outputs[0].token_ids`` grown) is turned into the tokens it added, and
``step`` hands over what arrived (waiting up to ``STEP_WAIT_S`` for something), so the
runner's loop neither spins nor changes. ``cancel`` aborts the request in TensorRT-LLM.

Text comes from iserve's own incremental detokenizer, token by token, exactly as the
PyTorch engine emits it (TensorRT-LLM is built with ``skip_tokenizer_init`` and asked
for no text), so both engines stream the same text for the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tokenizers import Tokenizer

from monitor_agent.engine.batching import (
    GenerationRequest,
    SequenceState,
    StepOutput,
    check_request,
)
from monitor_agent.engine.detokenizer import IncrementalDetokenizer
from monitor_agent.engine.trtllm.mapping import sampling_params
from services.models.arch import ArchSpec

# How long an idle step waits for TensorRT-LLM's next output before it returns.
STEP_WAIT_S = 0.05
# TensorRT-LLM's finish reasons that are iserve's "length"; every other one is "stop".
_LENGTH_REASONS = frozenset({"length"})


@dataclass(frozen=True)
class TrtLlmMemory:
    """Device bytes the LLM's build took on each of the group's devices."""

    device_bytes: tuple[int, ...]

    @property
    def resident_bytes(self) -> int:
        """Weights + KV cache pool + workspace of every rank, summed."""
        return sum(self.device_bytes)


class TrtLlmSequence:
    """A submitted request as the core sees it (the runner reads ``state``,
    ``admitted_at`` and ``prefilled_with``, as it does a SequenceHandle)."""

    __slots__ = (
        "admitted_at",
        "detokenizer",
        "generated",
        "prefilled_with",
        "request",
        "result",
        "state",
        "task",
    )

    def __init__(self, request: GenerationRequest, detokenizer: IncrementalDetokenizer) -> None:
        self.request = request
        self.state = SequenceState.RUNNING  # TensorRT-LLM queues it; iserve does not
        self.admitted_at: float | None = time.perf_counter()
        self.prefilled_with = 0  # TensorRT-LLM's in-flight batching does not say
        self.generated = 0  # tokens handed out so far
        self.detokenizer = detokenizer
        self.result: Any = None  # TensorRT-LLM's RequestOutput, once generate_async returned
        self.task: Any = None  # the concurrent future of the streaming coroutine

    def __repr__(self) -> str:
        return f"<TrtLlmSequence {self.state.value} generated={self.generated}>"


@dataclass(frozen=True)
class _Progress:
    """What one streamed RequestOutput added to its request."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    stop_reason: Any


class TrtLlmBatch:
    """The core the worker's EngineRunner drives, over TensorRT-LLM's own batching.

    Not thread-safe, like BatchEngine: one thread calls validate/submit/step/cancel; the
    streams run on the core's own event-loop thread and reach it through a queue.
    """

    def __init__(
        self,
        llm: Any,
        api: ModuleType,
        tokenizer: Tokenizer,
        *,
        spec: ArchSpec,
        max_batch: int,
        max_seq_len: int,
        eos_token_ids: frozenset[int],
        memory: TrtLlmMemory,
        step_wait_s: float = STEP_WAIT_S,
    ) -> None:
        self.llm = llm
        self.api = api
        self.tokenizer = tokenizer
        self.spec = spec
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.eos_token_ids = eos_token_ids
        self.memory = memory
        self.step_wait_s = step_wait_s
        self._running: set[TrtLlmSequence] = set()
        self._events: queue.SimpleQueue[tuple[TrtLlmSequence, _Progress | BaseException]] = (
            queue.SimpleQueue()
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="trtllm-streams", daemon=True
        )
        self._thread.start()

    @property
    def free_slots(self) -> int:
        return max(0, self.max_batch - len(self._running))

    @property
    def num_waiting(self) -> int:
        return 0  # requests wait inside TensorRT-LLM's scheduler, not here

    def validate(self, request: GenerationRequest) -> None:
        """ValueError, with a message for the user, when ``request`` cannot run here (the
        same checks and messages as the PyTorch engine's core)."""
        check_request(request, self.max_seq_len, self.spec.vocab_size)

    def submit(self, request: GenerationRequest) -> TrtLlmSequence:
        """Start streaming ``request`` (one :meth:`validate` passed) in TensorRT-LLM."""
        handle = TrtLlmSequence(
            request, IncrementalDetokenizer(self.tokenizer, list(request.prompt_ids))
        )
        params = sampling_params(self.api, request, self.eos_token_ids, self.spec.eos_token_ids)
        self._running.add(handle)
        handle.task = asyncio.run_coroutine_threadsafe(self._stream(handle, params), self._loop)
        return handle

    def cancel(self, handle: TrtLlmSequence) -> None:
        """Abort ``handle`` in TensorRT-LLM; nothing for a request that already ended."""
        if handle.state is not SequenceState.RUNNING:
            return
        handle.state = SequenceState.CANCELLED
        self._running.discard(handle)
        self._loop.call_soon_threadsafe(_abort, handle)

    def step(self) -> list[tuple[TrtLlmSequence, StepOutput]]:
        """The tokens TensorRT-LLM streamed since the last step, one StepOutput per token,
        waiting up to ``step_wait_s`` for the first. A request that failed in TensorRT-LLM
        raises its error here (the runner then fails the requests in flight, as after a
        failed forward of the PyTorch engine; their tokens of this step are dropped)."""
        try:
            events = [self._events.get(timeout=self.step_wait_s)]
        except queue.Empty:
            return []
        with contextlib.suppress(queue.Empty):
            while True:
                events.append(self._events.get_nowait())
        outputs: list[tuple[TrtLlmSequence, StepOutput]] = []
        failure: BaseException | None = None
        for handle, event in events:
            if handle.state is not SequenceState.RUNNING:
                continue  # cancelled or failed; what it streamed since goes nowhere
            if isinstance(event, BaseException):
                handle.state = SequenceState.CANCELLED
                self._running.discard(handle)
                failure = failure or event
                continue
            outputs += [(handle, output) for output in self._outputs(handle, event)]
        if failure is not None:
            raise failure
        return outputs

    def close(self) -> None:
        """Abort what runs and stop the stream thread."""
        for handle in list(self._running):
            self.cancel(handle)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _outputs(self, handle: TrtLlmSequence, progress: _Progress) -> list[StepOutput]:
        tokens = list(progress.token_ids)
        if progress.finished and not tokens:
            # TensorRT-LLM may leave the stop token out of the output; the PyTorch engine
            # ends on it, so the last output carries it (the EOS id when unknown).
            stop = progress.stop_reason
            tokens = [stop if isinstance(stop, int) else min(self.spec.eos_token_ids, default=0)]
        handle.generated += len(tokens)
        detokenizer = handle.detokenizer
        outputs = [StepOutput(t, detokenizer.add(t), False, None) for t in tokens[:-1]]
        last = tokens[-1]
        if not progress.finished:
            outputs.append(StepOutput(last, detokenizer.add(last), False, None))
            return outputs
        handle.state = SequenceState.FINISHED
        self._running.discard(handle)
        # As the PyTorch engine: a stop token adds no text, a last token by length does.
        if progress.finish_reason in _LENGTH_REASONS:
            outputs.append(
                StepOutput(last, detokenizer.add(last) + detokenizer.flush(), True, "length")
            )
        else:
            outputs.append(StepOutput(last, detokenizer.flush(), True, "stop"))
        return outputs

    async def _stream(self, handle: TrtLlmSequence, params: Any) -> None:
        """Runs on the loop thread: follow one request's stream into the queue."""
        seen = 0
        try:
            result = self.llm.generate_async(
                list(handle.request.prompt_ids), sampling_params=params, streaming=True
            )
            handle.result = result
            async for output in result:
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                progress = _Progress(
                    tuple(token_ids[seen:]),
                    bool(output.finished),
                    completion.finish_reason,
                    getattr(completion, "stop_reason", None),
                )
                seen = len(token_ids)
                if progress.token_ids or progress.finished:
                    self._events.put((handle, progress))
                if progress.finished:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the engine thread's step
            self._events.put((handle, exc))


def _abort(handle: TrtLlmSequence) -> None:
    """On the loop thread: stop the request in TensorRT-LLM and its streaming task."""
    if handle.result is not None and hasattr(handle.result, "abort"):
        handle.result.abort()
    if handle.task is not None:
        handle.task.cancel()
