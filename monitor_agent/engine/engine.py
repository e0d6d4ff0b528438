"""The engine a worker process serves: tokenizer, model, KV cache and its batch core.

``Engine.batch`` is the continuous-batching core (:mod:`monitor_agent.engine.batching`)
that the worker's engine thread drives. ``Engine.generate`` streams one request through
that same core for in-process callers: each generator steps the batch when it needs its
next token, so several generators iterated in turn share decode steps. A request holds
its cache slot until its generator finishes or is closed.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from monitor_agent.engine.batching import (
    BatchEngine,
    GenerationRequest,
    SequenceHandle,
    StepOutput,
)
from monitor_agent.engine.compression import (
    DEFAULT_PRUNE_FRACTION,
    CompressionSpec,
    apply_compression,
)
from monitor_agent.engine.distributed import DistributedModel, ParallelContext
from monitor_agent.engine.footprint import time_with_footprint
from monitor_agent.engine.kernel_checks import check_kernels
from monitor_agent.engine.kv_cache import kv_cache_quantization
from monitor_agent.engine.layer_clock import LayerClock
from monitor_agent.engine.loader import load_model, torch_dtype
from monitor_agent.engine.memory import (
    MemoryAccount,
    parameter_and_buffer_bytes,
    return_freed_memory,
    start_profiler_here,
)
from monitor_agent.engine.model import Transformer
from monitor_agent.engine.sampling import SamplingConfig
from services.models.arch import ArchSpec
from services.models.checkpoint import TOKENIZER_FILE, missing_tokenizer
from services.models.special_tokens import PromptEncoder, stop_eos_ids
from services.models.tokenizer_files import load_tokenizer

__all__ = ["Engine", "NoFreeSlot", "SamplingConfig", "StepOutput"]

# kv_cache_dtype values besides None (K and V in the model dtype).
KV_CACHE_DTYPES = ("int8",)


class NoFreeSlot(RuntimeError):
    """Every KV-cache slot is held by a running request."""


class Engine:
    """A model loaded for serving: max_batch sequences of up to max_seq_len tokens each.

    kv_cache_dtype None keeps K and V in the model dtype; "int8" quantizes them (see
    :mod:`monitor_agent.engine.kv_cache`). prefill_token_budget is passed to the batch
    core (default: max_seq_len prompt tokens admitted per step). With ``parallel`` this
    process is one rank of a tensor/pipeline-parallel group: the model is a
    DistributedModel over the rank's stage and shard, which rank 0's batch core drives
    and the other ranks serve through ``model.follow()``.

    time_layers keeps a layer clock (for profiling; on CUDA it synchronises the device
    around the layers of every forward). With it, ``footprint_layers`` (> this stage's
    layers: a fingerprint's profiling worker) is how many layers the full model's stage
    holds: on a CPU the forwards then cycle through copies of the stage's layers, so the
    clock times them with the full model's cache footprint (see
    :mod:`monitor_agent.engine.footprint`).

    weight_quant ("none", "int8", "int4"), pruning ("none", "2:4", "2:4-compact",
    "structured") and prune_fraction (structured only) compress every decoder layer while
    it loads (see :mod:`monitor_agent.engine.compression`); ValueError for other values.
    The fused kernels these need are checked first (KernelCheckFailed, see
    :mod:`monitor_agent.engine.kernel_checks`).
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        dtype: str = "float32",
        max_seq_len: int = 2048,
        max_batch: int = 1,
        device: str = "cpu",
        num_threads: int | None = None,
        kv_cache_dtype: str | None = None,
        prefill_token_budget: int | None = None,
        parallel: ParallelContext | None = None,
        weight_quant: str = "none",
        pruning: str = "none",
        prune_fraction: float = DEFAULT_PRUNE_FRACTION,
        time_layers: bool = False,
        footprint_layers: int = 0,
    ) -> None:
        directory = Path(checkpoint_dir)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be None (the model dtype) or one of {KV_CACHE_DTYPES}, "
                f"got {kv_cache_dtype!r}"
            )
        self.compression = CompressionSpec(weight_quant, pruning, prune_fraction)
        tokenizer_path = directory / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise missing_tokenizer(directory)
        # Before any weight is read: a fused kernel that computes the wrong thing on this
        # machine refuses the engine (KernelCheckFailed) instead of serving garbage.
        check_kernels(weight_quant=weight_quant, device=device, dtype=torch_dtype(dtype))
        if torch.device(device).type == "cpu":  # CUDA's peaks come from its allocator
            start_profiler_here()
        # One rank of a tensor/pipeline-parallel group holds its stage's shard, driven in
        # lock-step with the other ranks (see monitor_agent.engine.distributed).
        stage = {} if parallel is None else parallel.load_kwargs()
        # Each layer is compressed as soon as it is read (after sharding).
        compress = None
        if not self.compression.is_identity:
            compress = functools.partial(apply_compression, spec=self.compression)
        self.model = load_model(
            directory, dtype=dtype, device=device, on_layer_loaded=compress, **stage
        )
        return_freed_memory()
        if time_layers:
            self.model.layer_clock = LayerClock()
        if parallel is not None:
            self.model = DistributedModel(self.model, parallel)
        self.spec: ArchSpec = self.model.spec
        if not 0 < max_seq_len <= self.spec.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be in [1, {self.spec.max_position_embeddings}] "
                f"(the model's max_position_embeddings), got {max_seq_len}"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        with kv_cache_quantization(kv_cache_dtype or "none"):
            self.model.setup_caches(max_batch, max_seq_len)
        if time_layers and footprint_layers and torch.device(device).type == "cpu":
            time_with_footprint(self._stage, footprint_layers)
        self.tokenizer = load_tokenizer(directory, self.spec.family)
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self._encode = PromptEncoder(self.tokenizer, max_seq_len, self.spec.vocab_size)
        self.eos_token_ids = stop_eos_ids(self.spec.eos_token_ids, directory, self.spec.vocab_size)
        self.batch = BatchEngine(
            self.model,
            self.tokenizer,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            eos_token_ids=self.eos_token_ids,
            prefill_token_budget=prefill_token_budget or max_seq_len,
        )
        # Outputs stepped for Engine.generate's sequences, waiting for their generator.
        self._outboxes: dict[SequenceHandle, deque[StepOutput]] = {}

    @property
    def _stage(self) -> Transformer:
        """This rank's layers: the model, or a parallel rank's stage of it."""
        model = self.model
        return model.stage if isinstance(model, DistributedModel) else model

    @property
    def layer_clock(self) -> LayerClock | None:
        """Time this rank's decoder layers took (see monitor_agent.engine.model.LayerClock);
        None unless built with ``time_layers``."""
        return self._stage.layer_clock

    @property
    def memory(self) -> MemoryAccount:
        """Weights, KV cache and peak activation bytes (see monitor_agent.engine.memory)."""
        return self.batch.memory

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int = 0) -> list[int]:
        """Token ids of text, with the special tokens (BOS, EOS) transformers' AutoTokenizer
        would add for this checkpoint (none unless ``add_special_tokens``); PromptTooLong
        (a ValueError) for a text found longer than ``max_tokens`` tokens, or
        ``max_seq_len`` (services.models.special_tokens.PromptEncoder), without encoding
        all of it."""
        return self._encode(text, add_special_tokens, max_tokens)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingConfig,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[StepOutput]:
        """Stream up to max_tokens tokens continuing prompt_ids.

        Stops after an EOS token (unless sampling.ignore_eos) or a stop token, with
        finish_reason "stop"; after max_tokens with "length"; or silently, without a
        final output, as soon as should_stop() returns True. Raises ValueError at once
        for an empty prompt, ids outside the vocabulary, max_tokens < 1 or a sequence
        longer than max_seq_len. The cache slot is taken when iteration starts (NoFreeSlot
        if all are held) and given back when the iterator finishes or is closed. Not for
        use while another thread drives ``self.batch``.
        """
        request = GenerationRequest(tuple(prompt_ids), max_tokens, sampling)
        self.batch.validate(request)
        return self._generate(request, should_stop or _never)

    def resident_bytes(self) -> int:
        """Bytes held by parameters and buffers (KV cache, RoPE tables), each counted once."""
        return parameter_and_buffer_bytes(self.model)

    def _generate(
        self, request: GenerationRequest, should_stop: Callable[[], bool]
    ) -> Iterator[StepOutput]:
        if should_stop():
            return
        if not self.batch.free_slots or self.batch.num_waiting:
            raise NoFreeSlot(f"all {self.max_batch} sequence slots are in use")
        handle = self.batch.submit(request)
        outbox = self._outboxes[handle] = deque()
        try:
            while True:
                while not outbox:
                    self._step()
                output = outbox.popleft()
                if output.error is not None:
                    raise output.error
                yield output
                if output.finished or should_stop():
                    return
        finally:
            del self._outboxes[handle]
            self.batch.cancel(handle)

    def _step(self) -> None:
        """One batch step, each output filed for the generator that waits for it."""
        for handle, output in self.batch.step():
            outbox = self._outboxes.get(handle)
            if outbox is not None:
                outbox.append(output)


def _never() -> bool:
    return False
