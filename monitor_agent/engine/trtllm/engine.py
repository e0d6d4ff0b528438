"""The TensorRT-LLM engine: TensorRT-LLM's LLM API behind the PyTorch engine's interface.

:class:`TrtLlmEngine` offers what a worker uses of :class:`monitor_agent.engine.engine.
Engine`: ``batch`` (a core with ``validate``/``submit``/``step``/``cancel`` that the
worker's EngineRunner drives from its engine thread), ``memory.resident_bytes``,
``encode``, ``generate`` for in-process callers, ``layer_clock`` (None: TensorRT-LLM
times no layers for iserve) and ``close``.

TensorRT-LLM batches on its own (in-flight batching in its executor), so the core does
not step a model: ``submit`` starts ``llm.generate_async(prompt_ids, params,
streaming=True)`` on a private asyncio loop thread, each streamed ``RequestOutput`` is
turned into the tokens it added, and ``step`` hands over what arrived (waiting up to
``STEP_WAIT_S`` for something), so the runner's loop neither spins nor changes.
``cancel`` aborts the request in TensorRT-LLM.

A whole tp·pp group runs from this one process: TensorRT-LLM starts its own rank
processes on the first tp·pp visible CUDA devices, so before ``tensorrt_llm`` is imported
``CUDA_VISIBLE_DEVICES`` is narrowed to the group's devices.

Memory: TensorRT-LLM allocates weights, its KV-cache pool (bounded to max_batch ·
max_seq_len tokens, see :mod:`.mapping`) and its activation workspace while the LLM is
built, on devices and in processes torch's allocator does not see. The engine therefore
reports the device memory the build took: free bytes of each of the group's devices
before minus after (``torch.cuda.mem_get_info``), summed. Another process allocating on
those devices at the same moment would be counted too.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenizers import Tokenizer

from monitor_agent.engine.batching import GenerationRequest, SequenceState, StepOutput
from monitor_agent.engine.sampling import SamplingConfig
from monitor_agent.engine.trtllm.mapping import (
    TrtLlmConfig,
    check_options,
    llm_class,
    plan_llm,
    sampling_params,
)
from services.models.arch import ArchSpec
from services.models.checkpoint import TOKENIZER_FILE, InvalidCheckpoint, read_config
from services.models.families import parse_config
from services.models.special_tokens import encode_prompt, generation_eos_ids

log = logging.getLogger("iserve.engine.trtllm")

# How long an idle step waits for TensorRT-LLM's next output before it returns.
STEP_WAIT_S = 0.05
# TensorRT-LLM's finish reasons that are iserve's "length"; every other one is "stop".
_LENGTH_REASONS = frozenset({"length"})
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class TrtLlmMemory:
    """Device bytes the LLM's build took on each of the group's devices."""

    device_bytes: tuple[int, ...]

    @property
    def resident_bytes(self) -> int:
        """Weights + KV cache pool + workspace of every rank, summed."""
        return sum(self.device_bytes)


class TrtLlmSequence:
    """A submitted request as the core sees it (the runner reads ``state`` and
    ``admitted_at``, as it does a SequenceHandle)."""

    __slots__ = ("admitted_at", "generated", "request", "result", "state", "task", "text")

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.state = SequenceState.RUNNING  # TensorRT-LLM queues it; iserve does not
        self.admitted_at: float | None = time.perf_counter()
        self.generated = 0  # tokens handed out so far
        self.text = ""  # text handed out so far
        self.result: Any = None  # TensorRT-LLM's RequestOutput, once generate_async returned
        self.task: Any = None  # the concurrent future of the streaming coroutine

    def __repr__(self) -> str:
        return f"<TrtLlmSequence {self.state.value} generated={self.generated}>"


@dataclass(frozen=True)
class _Progress:
    """What one streamed RequestOutput added to its request."""

    token_ids: tuple[int, ...]
    text: str
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
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError("prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if len(prompt) + request.max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                f"max_seq_len ({self.max_seq_len})"
            )
        vocab = self.spec.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids outside [0, {vocab}): {bad[:5]}")

    def submit(self, request: GenerationRequest) -> TrtLlmSequence:
        """Start streaming ``request`` (one :meth:`validate` passed) in TensorRT-LLM."""
        handle = TrtLlmSequence(request)
        params = sampling_params(self.api, request, self.eos_token_ids)
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
        """The tokens TensorRT-LLM streamed since the last step, one StepOutput per token
        (a delta's text rides on its last token), waiting up to ``step_wait_s`` for the
        first. A request that failed in TensorRT-LLM raises its error here, after the
        outputs of the others were taken (the runner then fails the requests in flight,
        as after a failed forward of the PyTorch engine)."""
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
        handle.text += progress.text
        outputs = [StepOutput(t, "", False, None) for t in tokens[:-1]]
        reason = None
        if progress.finished:
            reason = "length" if progress.finish_reason in _LENGTH_REASONS else "stop"
            handle.state = SequenceState.FINISHED
            self._running.discard(handle)
        outputs.append(StepOutput(tokens[-1], progress.text, progress.finished, reason))
        return outputs

    async def _stream(self, handle: TrtLlmSequence, params: Any) -> None:
        """Runs on the loop thread: follow one request's stream into the queue."""
        seen_tokens, seen_text = 0, ""
        try:
            result = self.llm.generate_async(
                list(handle.request.prompt_ids), sampling_params=params, streaming=True
            )
            handle.result = result
            async for output in result:
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                text = completion.text or ""
                new_text = text[len(seen_text) :] if text.startswith(seen_text) else text
                progress = _Progress(
                    tuple(token_ids[seen_tokens:]),
                    new_text,
                    bool(output.finished),
                    completion.finish_reason,
                    getattr(completion, "stop_reason", None),
                )
                seen_tokens, seen_text = len(token_ids), text
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


class TrtLlmEngine:
    """A checkpoint served by TensorRT-LLM for the whole tp·pp group of ``config``.

    ``model`` is TensorRT-LLM's LLM object (what the worker calls the engine's model).

    Raises CannotMap (a ValueError) naming the option for a configuration that does not
    map (see :mod:`.mapping`), InvalidCheckpoint for a checkpoint without a tokenizer,
    and ImportError when ``tensorrt_llm`` is not installed. ``free_bytes(device)`` gives
    a device's free memory (default ``torch.cuda.mem_get_info``).
    """

    def __init__(
        self,
        config: TrtLlmConfig,
        *,
        free_bytes: Callable[[int], int] | None = None,
        step_wait_s: float = STEP_WAIT_S,
    ) -> None:
        self.layer_clock = None  # TensorRT-LLM times no layers for iserve
        check_options(config)
        directory = Path(config.checkpoint_dir)
        tokenizer_path = directory / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise InvalidCheckpoint(f"{TOKENIZER_FILE} is missing from {str(directory)!r}")
        self.spec: ArchSpec = parse_config(read_config(directory))
        if not 0 < config.max_seq_len <= self.spec.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be in [1, {self.spec.max_position_embeddings}] "
                f"(the model's max_position_embeddings), got {config.max_seq_len}"
            )
        if config.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {config.max_batch}")
        narrow_visible_devices(config.devices)
        api = importlib.import_module("tensorrt_llm")
        importlib.import_module("tensorrt_llm.llmapi")
        plan = plan_llm(config, self.spec.num_layers, api)
        llm_type = llm_class(api, plan.backend)
        free_bytes = free_bytes or _cuda_free_bytes
        # After narrowing, rank r of the group is visible device r.
        local = range(config.world_size)
        before = [free_bytes(device) for device in local]
        log.info("building TensorRT-LLM %s LLM: %s", plan.backend, _describe(plan.kwargs))
        self.model = llm_type(**plan.kwargs)
        after = [free_bytes(device) for device in local]
        memory = TrtLlmMemory(tuple(max(0, b - a) for b, a in zip(before, after, strict=True)))
        self.backend = plan.backend
        self.config = config
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.max_seq_len = config.max_seq_len
        self.max_batch = config.max_batch
        self.eos_token_ids = frozenset(self.spec.eos_token_ids) | generation_eos_ids(
            directory, self.spec.vocab_size
        )
        self.batch = TrtLlmBatch(
            self.model,
            api,
            spec=self.spec,
            max_batch=config.max_batch,
            max_seq_len=config.max_seq_len,
            eos_token_ids=self.eos_token_ids,
            memory=memory,
            step_wait_s=step_wait_s,
        )
        # Outputs stepped for generate's sequences, waiting for their generator.
        self._outboxes: dict[TrtLlmSequence, deque[StepOutput]] = {}

    @property
    def memory(self) -> TrtLlmMemory:
        return self.batch.memory

    def encode(self, text: str) -> list[int]:
        """Token ids of text, as the PyTorch engine encodes them (iserve's tokenizer,
        with the special tokens the checkpoint's tokenizer adds)."""
        return encode_prompt(self.tokenizer, text)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingConfig,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[StepOutput]:
        """Stream up to max_tokens tokens continuing prompt_ids, as Engine.generate does
        (ValueError at once for a request the engine cannot run). Not for use while
        another thread drives ``self.batch``."""
        request = GenerationRequest(tuple(prompt_ids), max_tokens, sampling)
        self.batch.validate(request)
        return self._generate(request, should_stop or (lambda: False))

    def close(self) -> None:
        """Abort running requests and shut TensorRT-LLM (and its rank processes) down."""
        self.batch.close()
        shutdown = getattr(self.model, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _generate(
        self, request: GenerationRequest, should_stop: Callable[[], bool]
    ) -> Iterator[StepOutput]:
        if should_stop():
            return
        handle = self.batch.submit(request)
        outbox = self._outboxes[handle] = deque()
        try:
            while True:
                while not outbox:
                    if should_stop():
                        return
                    for owner, output in self.batch.step():
                        if owner in self._outboxes:
                            self._outboxes[owner].append(output)
                output = outbox.popleft()
                yield output
                if output.finished or should_stop():
                    return
        finally:
            del self._outboxes[handle]
            self.batch.cancel(handle)


def narrow_visible_devices(devices: Sequence[int]) -> None:
    """Make ``devices`` (CUDA indices as this process sees them now) the only visible
    ones, in order, for this process and the rank processes TensorRT-LLM starts."""
    current = os.environ.get(CUDA_VISIBLE_DEVICES, "").strip()
    visible = [part.strip() for part in current.split(",")] if current else None
    chosen = []
    for device in devices:
        if visible is not None and not 0 <= device < len(visible):
            raise ValueError(
                f"CUDA device {device} is not visible ({CUDA_VISIBLE_DEVICES}={current!r})"
            )
        chosen.append(visible[device] if visible is not None else str(device))
    os.environ[CUDA_VISIBLE_DEVICES] = ",".join(chosen)


def _cuda_free_bytes(device: int) -> int:
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
