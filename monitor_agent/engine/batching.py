"""Continuous batching: sequences join and leave one running batch at step boundaries.

:class:`BatchEngine` owns the model's KV-cache slots, one per running sequence.
``submit`` queues a request (first in, first out); each ``step`` then

1. admits queued requests into free slots, oldest first, until the slots or the step's
   prefill token budget run out;
2. runs one batched decode forward for every sequence that was already running (their
   last tokens, positions and slots gathered into [B, 1] tensors);
3. prefills the newly admitted prompts, grouping prompts of similar length into one
   left-padded forward (:func:`plan_prefill_groups`);

and samples each row with its own SamplingConfig and torch.Generator, so a seeded
request draws the same tokens whatever company it keeps. A sequence that finishes gives
its slot back within the step; ``cancel`` gives it back at once.

Left padding. A row whose prompt has n tokens in a group padded to L puts the L - n pad
tokens first but gives them positions n … L-1, after the prompt. Every real token then
sits at its true position, the last column is every row's last prompt token (so
``last_token_only`` works), and the pads' keys land at positions the sequence has not
reached yet: the model attends only to positions at or before a query's own, and each
decode step writes its position before it reads it, so they are never seen.

Not thread-safe: one thread drives a BatchEngine (the worker's engine thread, or
Engine.generate's caller); ``validate`` alone touches no state.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer
from torch import nn

from monitor_agent.engine.detokenizer import IncrementalDetokenizer
from monitor_agent.engine.kv_cache import LayerKVCache
from monitor_agent.engine.memory import (
    MemoryAccount,
    forward_activation_bytes,
    measure_peak_allocation,
)
from monitor_agent.engine.sampling import SamplingConfig, make_generator, sample_token
from services.errors import IServeError

__all__ = [
    "BatchEngine",
    "GenerationRequest",
    "NonFiniteLogits",
    "SequenceHandle",
    "SequenceState",
    "StepOutput",
    "plan_prefill_groups",
]

# A prefill group may spend at most this fraction of its real tokens on padding.
MAX_PADDING_FRACTION = 0.25
# A group of prompts of different lengths attends through a [rows, longest, longest]
# mask (5 bytes an element on CPU: the boolean and its float copy); a group grows only
# while that stays within this many elements (80 MB), so long prompts are prefilled
# alone, or with prompts of their length, under a causal mask that costs nothing.
MAX_PREFILL_MASK_ELEMENTS = 16 << 20
# The token id fed at pad positions; any id in the vocabulary would do.
_PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: up to max_tokens tokens continuing prompt_ids."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass(frozen=True)
class StepOutput:
    """One generated token and the text it completed; or, with ``error`` set, the end of
    a sequence that failed alone (its slot is given back; no token)."""

    token_id: int
    text: str  # '' while a multi-byte character is incomplete
    finished: bool
    finish_reason: str | None  # "length" | "stop" (eos or stop token) | "error" | None
    error: Exception | None = None


class NonFiniteLogits(IServeError):
    """A sequence's logits hold NaN or an infinity: the model overflowed on it (weights
    or activations past its dtype's range). Only that sequence ends; the others of its
    batch go on (torch.multinomial failed the whole step)."""

    reason = "non_finite_logits"


class SequenceState(enum.Enum):
    WAITING = "waiting"  # queued for a slot
    RUNNING = "running"  # holds a slot
    FINISHED = "finished"  # produced its last token; slot given back
    CANCELLED = "cancelled"  # cancelled before finishing; slot (if any) given back


class SequenceHandle:
    """A submitted request as the batch sees it. Callers read it; BatchEngine writes it."""

    __slots__ = (
        "_detokenizer",
        "_generator",
        "_next_token",
        "_position",
        "_stop_ids",
        "admitted_at",
        "generated",
        "prefilled_with",
        "request",
        "slot",
        "state",
    )

    def __init__(
        self,
        request: GenerationRequest,
        stop_ids: frozenset[int],
        generator: torch.Generator,
        detokenizer: IncrementalDetokenizer,
    ) -> None:
        self.request = request
        self.state = SequenceState.WAITING
        self.slot: int | None = None
        self.generated = 0  # tokens produced so far
        self.admitted_at: float | None = None  # time.perf_counter() when it got a slot
        # Prompt tokens prefilled in the step that admitted it, its own included: its
        # first token waits for all of them (the step returns its outputs together).
        self.prefilled_with = 0
        self._stop_ids = stop_ids
        self._generator = generator
        self._detokenizer = detokenizer
        # The token sampled last step, to be fed at _position in the next decode.
        self._next_token = 0
        self._position = 0

    def __repr__(self) -> str:
        return f"<SequenceHandle {self.state.value} slot={self.slot} generated={self.generated}>"


def plan_prefill_groups(
    lengths: Sequence[int], max_padding_fraction: float = MAX_PADDING_FRACTION
) -> list[list[int]]:
    """Indices into ``lengths`` grouped for left-padded batched prefill.

    Prompts are taken shortest first; a group grows while its padded size (members ×
    longest) stays within (1 + max_padding_fraction) × its real tokens, and, unless
    every member has the longest's length, its mask within MAX_PREFILL_MASK_ELEMENTS.
    """
    groups: list[list[int]] = []
    group: list[int] = []
    real_tokens = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]
        members = len(group) + 1
        padded = real_tokens + length < members * length
        if group and (
            members * length > (1 + max_padding_fraction) * (real_tokens + length)
            or (padded and members * length * length > MAX_PREFILL_MASK_ELEMENTS)
        ):
            groups.append(group)
            group, real_tokens = [], 0
        group.append(index)
        real_tokens += length
    if group:
        groups.append(group)
    return groups


def check_request(request: GenerationRequest, max_seq_len: int, vocab_size: int) -> None:
    """ValueError, with a message for the user, when ``request`` cannot run on an engine
    holding ``max_seq_len`` tokens per sequence of a ``vocab_size`` vocabulary (both
    engines' one check)."""
    prompt = request.prompt_ids
    if not prompt:
        raise ValueError("prompt is empty")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if len(prompt) + request.max_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) exceeds "
            f"max_seq_len ({max_seq_len})"
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids outside [0, {vocab_size}): {bad[:5]}")


class BatchEngine:
    """The scheduler core: up to ``max_batch`` sequences decoding together.

    ``model`` must have had ``setup_caches(max_batch, max_seq_len)`` called and follow
    the forward contract ``model(input_ids [B, T], positions [B, T], slots [B], *,
    last_token_only) -> logits``. ``prefill_token_budget`` bounds the prompt tokens
    admitted in one step (the first waiting request is always admitted), so a burst of
    long prompts cannot stall running sequences for long; None means no bound.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        max_batch: int,
        max_seq_len: int,
        eos_token_ids: frozenset[int],
        prefill_token_budget: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_token_budget is not None and prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {prefill_token_budget}")
        self.model = model
        self.spec = model.spec
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.eos_token_ids = eos_token_ids
        self.prefill_token_budget = prefill_token_budget
        # The caches hold (or dequantize to) the activation dtype, whatever the weights are.
        cache = next(m for m in model.modules() if isinstance(m, LayerKVCache))
        self.device = cache.keys.device
        self._dtype_bytes = cache.dtype.itemsize
        self.memory = MemoryAccount.of_model(model)
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out 0 first
        self._waiting: deque[SequenceHandle] = deque()
        self._running: list[SequenceHandle] = []

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> tuple[SequenceHandle, ...]:
        """Sequences holding a slot, in the order they were admitted."""
        return tuple(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def validate(self, request: GenerationRequest) -> None:
        """ValueError, with a message for the user, when ``request`` cannot run here: the
        one check of a generation request, run once where it enters (the worker's
        servicer, ``Engine.generate``); :meth:`submit` trusts it."""
        check_request(request, self.max_seq_len, self.spec.vocab_size)

    def submit(self, request: GenerationRequest) -> SequenceHandle:
        """Queue ``request`` (one :meth:`validate` passed); it gets a slot at the next
        step with one free (FIFO)."""
        sampling = request.sampling
        stop_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        handle = SequenceHandle(
            request,
            stop_ids,
            make_generator(sampling.seed, self.device),
            IncrementalDetokenizer(self.tokenizer, list(request.prompt_ids)),
        )
        self._waiting.append(handle)
        return handle

    def cancel(self, handle: SequenceHandle) -> None:
        """Drop ``handle`` now (between steps): out of the queue, or its slot freed.
        Does nothing for a sequence that already ended."""
        if handle.state is SequenceState.WAITING:
            self._waiting.remove(handle)
        elif handle.state is SequenceState.RUNNING:
            self._running.remove(handle)
            self._release(handle)
        else:
            return
        handle.state = SequenceState.CANCELLED

    @torch.inference_mode()
    def step(self) -> list[tuple[SequenceHandle, StepOutput]]:
        """Admit, decode and prefill as the module docstring says; one output per
        sequence that produced a token this step, in no particular order."""
        # In slot order, so that a full batch reads the KV cache as a view, not a copy.
        decoding = sorted(self._running, key=_slot_of)
        try:
            joined = self._admit()
            outputs = self._decode(decoding) if decoding else []
            lengths = [len(h.request.prompt_ids) for h in joined]
            for group in plan_prefill_groups(lengths):
                outputs += self._prefill(sorted((joined[i] for i in group), key=_slot_of))
            return outputs
        finally:
            # Also after a failed forward, so that running and the free slots agree.
            self._running = [h for h in self._running if h.state is SequenceState.RUNNING]

    def _admit(self) -> list[SequenceHandle]:
        joined: list[SequenceHandle] = []
        prompt_tokens = 0
        budget = self.prefill_token_budget
        while self._waiting and self._free_slots:
            length = len(self._waiting[0].request.prompt_ids)
            if joined and budget is not None and prompt_tokens + length > budget:
                break
            handle = self._waiting.popleft()
            handle.slot = self._free_slots.pop()
            handle.state = SequenceState.RUNNING
            handle.admitted_at = time.perf_counter()
            joined.append(handle)
            self._running.append(handle)
            prompt_tokens += length
        for handle in joined:
            handle.prefilled_with = prompt_tokens
        return joined

    def _decode(self, batch: list[SequenceHandle]) -> list[tuple[SequenceHandle, StepOutput]]:
        # One tensor of [token, position, slot] rows, read by column: each torch.tensor
        # call costs a few microseconds of a small model's step.
        columns = torch.tensor(
            [[h._next_token, h._position, h.slot] for h in batch],
            dtype=torch.long,
            device=self.device,
        )
        ids, positions, slots = columns[:, 0:1], columns[:, 1:2], columns[:, 2]
        logits = self.forward_measured(
            lambda: self.model(ids, positions, slots, last_token_only=True),
            rows=len(batch),
            tokens_per_row=1,
            kv_len=max(h._position for h in batch) + 1,
        )[:, -1]
        for handle in batch:
            handle._position += 1
        return self._advance(batch, logits)

    def _prefill(self, group: list[SequenceHandle]) -> list[tuple[SequenceHandle, StepOutput]]:
        longest = max(len(h.request.prompt_ids) for h in group)
        rows, positions = [], []
        for handle in group:
            prompt = handle.request.prompt_ids
            pad = longest - len(prompt)
            rows.append([_PAD_TOKEN_ID] * pad + list(prompt))
            positions.append([*range(len(prompt), longest), *range(len(prompt))])
            handle._position = len(prompt)
        device = self.device
        inputs = (
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor([h.slot for h in group], dtype=torch.long, device=device),
        )
        logits = self.forward_measured(
            lambda: self.model(*inputs, last_token_only=True),
            rows=len(group),
            tokens_per_row=longest,
            kv_len=longest,
        )[:, -1]
        return self._advance(group, logits)

    def _advance(
        self, batch: list[SequenceHandle], logits: torch.Tensor
    ) -> list[tuple[SequenceHandle, StepOutput]]:
        """Sample each row of logits [B, vocab] and emit it for its sequence; a row that
        is not finite ends its sequence alone (NonFiniteLogits)."""
        tokens = logits.argmax(dim=-1).tolist()
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        outputs = []
        for row, handle in enumerate(batch):
            if not finite[row]:
                outputs.append((handle, self._fail(handle, logits.dtype)))
                continue
            if not handle.request.sampling.greedy:
                tokens[row] = sample_token(logits[row], handle.request.sampling, handle._generator)
            outputs.append((handle, self._emit(handle, tokens[row])))
        return outputs

    def _fail(self, handle: SequenceHandle, dtype: torch.dtype) -> StepOutput:
        self._release(handle)
        handle.state = SequenceState.FINISHED
        error = NonFiniteLogits(
            f"the model's logits for this request hold NaN or an infinity at token "
            f"{handle.generated + 1}: it overflows in {str(dtype).removeprefix('torch.')} "
            "(weights or activations past the dtype's range); the request ends here"
        )
        return StepOutput(-1, "", True, "error", error)

    def _emit(self, handle: SequenceHandle, token: int) -> StepOutput:
        handle.generated += 1
        detokenizer = handle._detokenizer
        if token in handle._stop_ids:
            output = StepOutput(token, detokenizer.flush(), True, "stop")
        elif handle.generated == handle.request.max_tokens:
            output = StepOutput(token, detokenizer.add(token) + detokenizer.flush(), True, "length")
        else:
            output = StepOutput(token, detokenizer.add(token), False, None)
        if output.finished:
            self._release(handle)
            handle.state = SequenceState.FINISHED
        else:
            handle._next_token = token
        return output

    def _release(self, handle: SequenceHandle) -> None:
        assert handle.slot is not None
        self._free_slots.append(handle.slot)

    def forward_measured(
        self, run: Callable[[], torch.Tensor], *, rows: int, tokens_per_row: int, kv_len: int
    ) -> torch.Tensor:
        """``run()`` (one forward pass of this shape); on CPU, a pass that could set a new
        activation peak is measured (monitor_agent.engine.memory). A follower rank
        measures its steps through this too (monitor_agent.worker.follower)."""
        if self.device.type != "cpu":
            return run()  # the CUDA allocator keeps its own peak
        shape = forward_activation_bytes(
            self.spec,
            self._dtype_bytes,
            rows=rows,
            tokens_per_row=tokens_per_row,
            kv_len=kv_len,
            logit_rows=rows,
        )
        if not self.memory.should_measure(shape):
            return run()
        logits, peak = measure_peak_allocation(run)
        if peak is not None:
            self.memory.observe_measured(shape, peak)
        return logits


def _slot_of(handle: SequenceHandle) -> int:
    assert handle.slot is not None
    return handle.slot
