"""Choosing the next token from logits: greedy, temperature, top-k and top-p.

Randomness comes only from a per-request torch.Generator, so a request with a seed
produces the same tokens every time, whatever else the engine is running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.stop_strings import check_stop_strings

# A temperature below this samples as greedy: dividing float32 logits by a temperature
# near 1e-38 overflows them to infinity, and the NaN probabilities that follow fail the
# whole batch's step. vLLM draws the same line (its _SAMPLING_EPS).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """How one request picks tokens and when it stops early."""

    temperature: float = 0.0  # 0 (below GREEDY_BELOW_TEMPERATURE) => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Text that ends the generation (services.stop_strings).
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_stop_strings(self.stop_strings)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with ``seed``, or from fresh entropy when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> int:
    """The next token id drawn from logits [vocab] under config."""
    if config.greedy:
        return int(torch.argmax(logits))
    scaled = logits.float() / config.temperature
    if 0 < config.top_k < scaled.shape[-1]:
        candidate_logits, candidate_ids = torch.topk(scaled, config.top_k)  # sorted, descending
    else:
        candidate_logits, candidate_ids = torch.sort(scaled, descending=True)
    probs = torch.softmax(candidate_logits, dim=-1)
    if config.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the tokens
        # ranked above it already hold top_p. The most likely token is always kept.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= config.top_p, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(candidate_ids[choice])
