"""Shapes of decoder-only models, read from a Hugging Face ``config.json``.

An :class:`ArchSpec` is everything the control plane and the engine need to know about a
model's shape: sizes, tensor names, parameter and KV-cache bytes. It is built once from
the checkpoint's config (written by transformers 4 or 5) and never imports torch, so the
fingerprint cutter, the estimator and the engine can all share it.

Families are registered in ``_FAMILIES``: a family turns a config dict into an
``ArchSpec`` and lists the checkpoint tensors that spec implies. Llama and Mistral share
one layout; Qwen2, Falcon and GPT-J are expected to arrive as further entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.models.errors import InvalidConfig, UnsupportedArchitecture

__all__ = ["ArchSpec", "InvalidConfig", "UnsupportedArchitecture", "supported_model_types"]

# Bytes per element of the dtypes a checkpoint may declare (config "dtype"/"torch_dtype").
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

# Tensors that some exporters write but that carry no learned weights (recomputed at load).
HARMLESS_EXTRA_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ArchSpec:
    """Shape of a decoder-only transformer; sizes are element counts unless named bytes."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    mlp_bias: bool = False
    # Mistral-style local attention: a query sees at most this many keys (itself included).
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ArchSpec:
        """Build the spec from a parsed ``config.json``.

        Raises UnsupportedArchitecture for families or features iserve cannot run, and
        InvalidConfig for missing or inconsistent fields; both messages name the field.
        """
        if not isinstance(cfg, Mapping):
            raise InvalidConfig(f"config must be a JSON object, got {type(cfg).__name__}")
        family = _family_of(cfg)
        return _FAMILIES[family].parse(cfg, family)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the checkpoint's declared dtype."""
        return DTYPE_BYTES[self.torch_dtype]

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by Hugging Face name, with its shape."""
        return _FAMILIES[self.family].tensors(self)

    def parameter_count(self) -> int:
        """Number of learned parameters (a tied LM head counted once)."""
        return sum(math.prod(shape) for shape in self.expected_tensors().values())

    def weight_bytes(self, dtype_bytes: int | None = None) -> int:
        """Bytes of all parameters at ``dtype_bytes`` per element (default: config dtype)."""
        return self.parameter_count() * (self.dtype_bytes if dtype_bytes is None else dtype_bytes)

    def kv_cache_bytes(
        self, max_seq_len: int, batch_size: int, dtype_bytes: int | None = None
    ) -> int:
        """Bytes of a static K and V cache for ``batch_size`` sequences of ``max_seq_len``."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        element_bytes = self.dtype_bytes if dtype_bytes is None else dtype_bytes
        return per_token * max_seq_len * batch_size * element_bytes


@dataclass(frozen=True)
class _Family:
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    parse: Callable[[Mapping[str, Any], str], ArchSpec]
    tensors: Callable[[ArchSpec], dict[str, tuple[int, ...]]]


def _family_of(cfg: Mapping[str, Any]) -> str:
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    if model_type is None and not architectures:
        raise InvalidConfig("config has neither 'model_type' nor 'architectures'")
    if architectures and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise InvalidConfig(f"'architectures' must be a list of strings, got {architectures!r}")
    for family, known in _FAMILIES.items():
        if model_type is not None and model_type not in known.model_types:
            continue
        if architectures and not set(architectures) & set(known.architectures):
            if model_type is None:
                continue
            raise UnsupportedArchitecture(
                f"architectures {architectures} are not supported for model_type "
                f"{model_type!r}; supported: {list(known.architectures)}"
            )
        return family
    what = f"model_type {model_type!r}" if model_type is not None else f"{architectures}"
    raise UnsupportedArchitecture(
        f"{what} is not supported; supported model types: {supported_model_types()}"
    )


def _positive_int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise InvalidConfig(f"config is missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidConfig(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _positive_float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidConfig(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _flag(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidConfig(f"config field {key!r} must be true or false, got {value!r}")
    return value


def _token_id(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidConfig(f"config field {key!r} must hold token ids, got {value!r}")
    return value


def _eos_token_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    value = cfg.get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(_token_id(v, "eos_token_id") for v in values)


def _dtype(cfg: Mapping[str, Any]) -> str:
    # transformers 5 writes "dtype"; transformers 4 wrote "torch_dtype".
    value = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if isinstance(value, str):
        value = value.removeprefix("torch.")
    if value not in DTYPE_BYTES:
        raise InvalidConfig(f"config dtype {value!r} is not one of {sorted(DTYPE_BYTES)}")
    return value


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    """Base of the rotary frequencies; only unscaled ("default") RoPE is supported.

    transformers 5 writes ``rope_parameters: {"rope_theta", "rope_type"}``; transformers
    4 wrote ``rope_theta`` at top level plus an optional ``rope_scaling`` dict.
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise InvalidConfig(f"config field {name!r} must be an object, got {block!r}")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type not in (None, "default"):
            raise UnsupportedArchitecture(
                f"{name} type {rope_type!r} is not supported; only unscaled (default) RoPE is"
            )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitecture("partial rotary embeddings are not supported for this family")
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return _positive_float(params, "rope_theta", 10000.0)
    return _positive_float(cfg, "rope_theta", 10000.0)


def _parse_llama_like(cfg: Mapping[str, Any], family: str) -> ArchSpec:
    if cfg.get("quantization_config") is not None:
        raise UnsupportedArchitecture("pre-quantized checkpoints are not supported yet")
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedArchitecture(f"hidden_act {hidden_act!r} is not supported; need 'silu'")
    hidden_size = _positive_int(cfg, "hidden_size")
    num_heads = _positive_int(cfg, "num_attention_heads")
    num_kv_heads = _positive_int(cfg, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise InvalidConfig(
            f"num_attention_heads ({num_heads}) is not divisible by "
            f"num_key_value_heads ({num_kv_heads})"
        )
    if cfg.get("head_dim") is None:
        if hidden_size % num_heads:
            raise InvalidConfig(
                f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads})"
            )
        head_dim = hidden_size // num_heads
    else:
        head_dim = _positive_int(cfg, "head_dim")
    if head_dim % 2:
        raise InvalidConfig(f"head_dim ({head_dim}) must be even for rotary embeddings")
    bos = cfg.get("bos_token_id")
    sliding_window = cfg.get("sliding_window") if family == "mistral" else None
    if sliding_window is not None:
        sliding_window = _positive_int(cfg, "sliding_window")
    spec = ArchSpec(
        family=family,
        hidden_size=hidden_size,
        num_layers=_positive_int(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        vocab_size=_positive_int(cfg, "vocab_size"),
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", 2048),
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(cfg),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
        torch_dtype=_dtype(cfg),
        bos_token_id=None if bos is None else _token_id(bos, "bos_token_id"),
        eos_token_ids=_eos_token_ids(cfg),
        attention_bias=_flag(cfg, "attention_bias"),
        mlp_bias=_flag(cfg, "mlp_bias"),
        sliding_window=sliding_window,
    )
    for key, token in [("bos_token_id", spec.bos_token_id)] + [
        ("eos_token_id", t) for t in spec.eos_token_ids
    ]:
        if token is not None and token >= spec.vocab_size:
            raise InvalidConfig(f"{key} {token} is outside the vocabulary ({spec.vocab_size})")
    return spec


def _llama_tensors(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, hidden)}
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        projections = {
            f"{attn}.q_proj": (q_out, hidden),
            f"{attn}.k_proj": (kv_out, hidden),
            f"{attn}.v_proj": (kv_out, hidden),
            f"{attn}.o_proj": (hidden, q_out),
        }
        mlp_projections = {
            f"{mlp}.gate_proj": (spec.intermediate_size, hidden),
            f"{mlp}.up_proj": (spec.intermediate_size, hidden),
            f"{mlp}.down_proj": (hidden, spec.intermediate_size),
        }
        for group, has_bias in (
            (projections, spec.attention_bias),
            (mlp_projections, spec.mlp_bias),
        ):
            for name, shape in group.items():
                tensors[f"{name}.weight"] = shape
                if has_bias:
                    tensors[f"{name}.bias"] = (shape[0],)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
    tensors["model.norm.weight"] = (hidden,)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = (spec.vocab_size, hidden)
    return tensors


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(("llama",), ("LlamaForCausalLM",), _parse_llama_like, _llama_tensors),
    "mistral": _Family(("mistral",), ("MistralForCausalLM",), _parse_llama_like, _llama_tensors),
}


def supported_model_types() -> list[str]:
    """The ``model_type`` values :meth:`ArchSpec.from_hf_config` accepts."""
    return sorted(t for family in _FAMILIES.values() for t in family.model_types)
