"""RoPE frequency scaling a checkpoint's config declares (its own module: both the
architecture spec and the config reader use it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ROPE_SCALING_KINDS", "RopeScaling"]

ROPE_SCALING_KINDS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches its rotary frequencies beyond the context it was
    pretrained on (transformers' ``rope_parameters`` / ``rope_scaling``).

    ``linear``: every frequency divided by ``factor`` (positions compressed ``factor``
    times). ``llama3`` (Llama 3.1 and later): a frequency whose wavelength is longer than
    ``original_max_position_embeddings / low_freq_factor`` tokens is divided by
    ``factor``, one shorter than ``original_max_position_embeddings / high_freq_factor``
    is kept, and those between are blended linearly in ``original / wavelength``.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"RoPE scaling must be one of {ROPE_SCALING_KINDS}, got {self.kind!r}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"RoPE scaling factor must be positive and finite, got {self.factor}")
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor < math.inf
            and self.original_max_position_embeddings > 0
        ):
            raise ValueError(
                "llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor and a "
                f"positive original_max_position_embeddings, got {self}"
            )
