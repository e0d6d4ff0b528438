"""The TensorRT-LLM engine: TensorRT-LLM's LLM API behind the PyTorch engine's interface.

:class:`TrtLlmEngine` offers what a worker uses of :class:`monitor_agent.engine.engine.
Engine`: ``batch`` (:class:`.core.TrtLlmBatch`, the core the worker's EngineRunner drives
from its engine thread), ``memory.resident_bytes``, ``encode``, ``generate`` for
in-process callers, ``layer_clock`` (None: TensorRT-LLM times no layers for iserve) and
``close``.

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

import importlib
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from monitor_agent.engine.batching import GenerationRequest, StepOutput
from monitor_agent.engine.sampling import SamplingConfig
from monitor_agent.engine.trtllm.core import STEP_WAIT_S, TrtLlmBatch, TrtLlmMemory, TrtLlmSequence
from monitor_agent.engine.trtllm.mapping import (
    TrtLlmConfig,
    check_layer_map,
    check_options,
    llm_class,
    plan_llm,
)
from services.models.arch import ArchSpec
from services.models.checkpoint import (
    TOKENIZER_FILE,
    missing_tokenizer,
    read_config,
)
from services.models.families import parse_config
from services.models.special_tokens import PromptEncoder, stop_eos_ids
from services.models.tokenizer_files import load_tokenizer

log = logging.getLogger("iserve.engine.trtllm")

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


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
            raise missing_tokenizer(directory)
        self.spec: ArchSpec = parse_config(read_config(directory))
        if not 0 < config.max_seq_len <= self.spec.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be in [1, {self.spec.max_position_embeddings}] "
                f"(the model's max_position_embeddings), got {config.max_seq_len}"
            )
        if config.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {config.max_batch}")
        check_layer_map(config, self.spec.num_layers)
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
        self.tokenizer = load_tokenizer(directory, self.spec.family)
        self.max_seq_len = config.max_seq_len
        self._encode = PromptEncoder(self.tokenizer, config.max_seq_len, self.spec.vocab_size)
        self.max_batch = config.max_batch
        self.eos_token_ids = stop_eos_ids(self.spec.eos_token_ids, directory, self.spec.vocab_size)
        self.batch = TrtLlmBatch(
            self.model,
            api,
            self.tokenizer,
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

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int = 0) -> list[int]:
        """Token ids of text, as the PyTorch engine encodes them (iserve's tokenizer,
        with the special tokens the checkpoint's tokenizer adds unless not
        ``add_special_tokens``; a text found longer than ``max_tokens`` tokens, or
        ``max_seq_len``, refused without encoding all of it)."""
        return self._encode(text, add_special_tokens, max_tokens)

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
