"""What a family is: the entry each family module defines, and the shape a synthetic
checkpoint's ``config.json`` is written for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.models.arch import LayerTensors, ParseConfig


@dataclass(frozen=True)
class ConfigRequest:
    """The shape ``create_checkpoint`` asks a family to describe in a ``config.json``."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int | None  # None: the family's usual MLP width
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str
    rope_theta: float
    norm_eps: float | None  # None: the family's usual epsilon
    sliding_window: int | None
    bos_token_id: int
    eos_token_id: int


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    parse: ParseConfig
    layer_tensors: LayerTensors
    build_config: Callable[[ConfigRequest], dict[str, Any]]
    embedding: str  # checkpoint name of the token embedding
    final_norm: str  # checkpoint name of the final norm, without ".weight"
    layer_count_keys: tuple[str, ...] = ("num_hidden_layers",)
    # Extra tensors old exporters saved that hold no weights (GPT-J's causal-mask buffers).
    harmless_suffixes: tuple[str, ...] = ()
