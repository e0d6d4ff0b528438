"""The model families iserve serves, each a :class:`Family` entry in ``FAMILIES``.

A family knows three things about its Hugging Face checkpoints: how to read a
``config.json`` into an :class:`~services.models.arch.ArchSpec`, which tensors one decoder
layer holds (names, shapes, and the engine parameters each fills), and how to write a
``config.json`` for a synthetic checkpoint. Everything else (embedding, final norm, LM
head, stage slicing) is common and lives in ``arch.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.models.arch import LayerTensors, ParseConfig
from services.models.errors import InvalidConfig, UnsupportedArchitecture


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


def _registry() -> dict[str, Family]:
    from services.models.families import falcon, gptj, llama

    families = [llama.LLAMA, llama.MISTRAL, llama.QWEN2, falcon.FALCON, gptj.GPTJ]
    return {family.name: family for family in families}


FAMILIES: dict[str, Family] = _registry()


def family_of(cfg: Mapping[str, Any]) -> Family:
    """The family a config belongs to, by ``model_type`` and ``architectures``."""
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    if model_type is None and not architectures:
        raise InvalidConfig("config has neither 'model_type' nor 'architectures'")
    if architectures and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise InvalidConfig(f"'architectures' must be a list of strings, got {architectures!r}")
    for family in FAMILIES.values():
        if model_type is not None and model_type not in family.model_types:
            continue
        if architectures and not set(architectures) & set(family.architectures):
            if model_type is None:
                continue
            raise UnsupportedArchitecture(
                f"architectures {architectures} are not supported for model_type "
                f"{model_type!r}; supported: {list(family.architectures)}"
            )
        return family
    what = f"model_type {model_type!r}" if model_type is not None else f"{architectures}"
    supported = sorted(t for family in FAMILIES.values() for t in family.model_types)
    raise UnsupportedArchitecture(f"{what} is not supported; supported model types: {supported}")
