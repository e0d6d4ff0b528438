"""The engine a worker process serves: tokenizer, model, cache slots and the decode loop.

``Engine.generate`` prefills the prompt into a free cache slot, then decodes one token
per step, yielding a StepOutput per token with the text that token made final. Each
request holds its slot until its generator finishes or is closed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from monitor_agent.engine.detokenizer import IncrementalDetokenizer
from monitor_agent.engine.loader import load_model
from monitor_agent.engine.sampling import SamplingConfig, make_generator, sample_token
from services.models.arch import ArchSpec
from services.models.checkpoint import TOKENIZER_FILE, InvalidCheckpoint

__all__ = ["Engine", "NoFreeSlot", "SamplingConfig", "StepOutput"]


@dataclass(frozen=True)
class StepOutput:
    """One generated token and the text it completed."""

    token_id: int
    text: str  # '' while a multi-byte character is incomplete
    finished: bool
    finish_reason: str | None  # "length" | "stop" (eos or stop token) | None


class NoFreeSlot(RuntimeError):
    """Every KV-cache slot is held by a running request."""


class Engine:
    """A model loaded for serving: max_batch sequences of up to max_seq_len tokens each."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        dtype: str = "float32",
        max_seq_len: int = 2048,
        max_batch: int = 1,
        device: str = "cpu",
        num_threads: int | None = None,
    ) -> None:
        directory = Path(checkpoint_dir)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        tokenizer_path = directory / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise InvalidCheckpoint(f"{TOKENIZER_FILE} is missing from {str(directory)!r}")
        self.model = load_model(directory, dtype=dtype, device=device)
        self.spec: ArchSpec = self.model.spec
        if not 0 < max_seq_len <= self.spec.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be in [1, {self.spec.max_position_embeddings}] "
                f"(the model's max_position_embeddings), got {max_seq_len}"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model.setup_caches(max_batch, max_seq_len)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.eos_token_ids = frozenset(self.spec.eos_token_ids) | _generation_eos_ids(directory)
        self._add_bos = _tokenizer_adds_bos(directory) and self.spec.bos_token_id is not None
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._slot_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """Token ids of text, starting with BOS as Hugging Face Llama tokenizers do."""
        ids = self.tokenizer.encode(text).ids
        bos = self.spec.bos_token_id
        if self._add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

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
        if all are held) and given back when the iterator finishes or is closed.
        """
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt) + max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_seq_len ({self.max_seq_len})"
            )
        vocab = self.spec.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt holds token ids outside [0, {vocab}): {bad[:5]}")
        return self._generate(prompt, max_tokens, sampling, should_stop or _never)

    def resident_bytes(self) -> int:
        """Bytes held by parameters and buffers (KV cache, RoPE tables), each counted once."""
        seen: set[int] = set()
        total = 0
        for tensor in (*self.model.parameters(), *self.model.buffers()):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def _generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingConfig,
        should_stop: Callable[[], bool],
    ) -> Iterator[StepOutput]:
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        generator = make_generator(sampling.seed, self.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt)
        if should_stop():
            return
        slot = self._acquire_slot()
        try:
            token = self._prefill(slot, prompt, sampling, generator)
            position = len(prompt)
            for generated in range(1, max_tokens + 1):
                if token in stop_ids:
                    yield StepOutput(token, detokenizer.flush(), True, "stop")
                    return
                text = detokenizer.add(token)
                if generated == max_tokens:
                    yield StepOutput(token, text + detokenizer.flush(), True, "length")
                    return
                yield StepOutput(token, text, False, None)
                if should_stop():
                    return
                token = self._decode(slot, token, position, sampling, generator)
                position += 1
        finally:
            self._release_slot(slot)

    @torch.inference_mode()
    def _prefill(
        self, slot: int, prompt: list[int], sampling: SamplingConfig, generator: torch.Generator
    ) -> int:
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        positions = torch.arange(len(prompt), device=self.device).unsqueeze(0)
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        logits = self.model(ids, positions, slots, last_token_only=True)
        return sample_token(logits[0, -1], sampling, generator)

    @torch.inference_mode()
    def _decode(
        self,
        slot: int,
        token: int,
        position: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> int:
        ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        positions = torch.tensor([[position]], dtype=torch.long, device=self.device)
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        logits = self.model(ids, positions, slots)
        return sample_token(logits[0, -1], sampling, generator)

    def _acquire_slot(self) -> int:
        with self._slot_lock:
            if not self._free_slots:
                raise NoFreeSlot(f"all {self.max_batch} sequence slots are in use")
            return self._free_slots.pop()

    def _release_slot(self, slot: int) -> None:
        with self._slot_lock:
            self._free_slots.append(slot)


def _never() -> bool:
    return False


def _generation_eos_ids(directory: Path) -> frozenset[int]:
    """EOS ids from generation_config.json, which chat models often extend beyond config.json."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return frozenset()
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise InvalidCheckpoint(f"generation_config.json is malformed: {exc}") from exc
    values = value if isinstance(value, list) else [value]
    return frozenset(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def _tokenizer_adds_bos(directory: Path) -> bool:
    """Whether prompts start with BOS: tokenizer_config.json's add_bos_token, default yes."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return True
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("add_bos_token", True)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return True
    return value is not False
