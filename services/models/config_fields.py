"""Reading single fields of a Hugging Face ``config.json``, with errors that name the field.

Every family parser uses these, so that a user who registers a broken config reads the
same kind of message whatever the model: which field, what it holds, what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from services.errors import shown
from services.models.errors import InvalidConfig, engine_cannot_run
from services.models.rope_scaling import ROPE_SCALING_KINDS, RopeScaling

# Bytes per element of the dtypes a checkpoint may declare (config "dtype"/"torch_dtype").
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

# The largest value iserve accepts for each size field, under every name families use for
# it: generous beyond any published model (Llama-3.1-405B: 126 layers, hidden 16384,
# 53248 MLP; vocabularies of 256k; contexts of 10M), small enough that a config claiming
# 10^12 layers is refused before its 10^13 tensor names are listed, and under 2^32, so
# that every size fits the API's uint32 shape fields.
_LAYERS, _HEADS, _HIDDEN, _MLP = 1024, 4096, 1 << 17, 1 << 20
_VOCAB, _POSITIONS = 1 << 22, 1 << 24
FIELD_MAXIMA: dict[str, int] = {
    "num_hidden_layers": _LAYERS,
    "n_layer": _LAYERS,
    "num_attention_heads": _HEADS,
    "n_head": _HEADS,
    "num_key_value_heads": _HEADS,
    "num_kv_heads": _HEADS,
    "hidden_size": _HIDDEN,
    "n_embd": _HIDDEN,
    "head_dim": _HIDDEN,
    "rotary_dim": _HIDDEN,
    "intermediate_size": _MLP,
    "ffn_hidden_size": _MLP,
    "n_inner": _MLP,
    "vocab_size": _VOCAB,
    "max_position_embeddings": _POSITIONS,
    "n_positions": _POSITIONS,
    "sliding_window": _POSITIONS,
}
# Any other integer field.
_DEFAULT_MAXIMUM = 2**31 - 1


def first_present(cfg: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The first of ``keys`` the config sets (to anything but null); else the first key.

    Families whose configs have used several names for one field (GPT-J's ``n_embd`` and
    ``hidden_size``) read whichever is there and name the canonical one in errors.
    """
    return next((key for key in keys if cfg.get(key) is not None), keys[0])


def positive_int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if value is None:
        raise InvalidConfig(f"config is missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidConfig(f"config field {key!r} must be a positive integer, got {shown(value)}")
    maximum = FIELD_MAXIMA.get(key, _DEFAULT_MAXIMUM)
    if value > maximum:
        raise InvalidConfig(
            f"config field {key!r} is {shown(value)}, more than the {maximum} iserve accepts"
        )
    return value


def positive_float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        value = default
    number = _as_float(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise InvalidConfig(
            f"config field {key!r} must be a positive finite number, got {shown(value)}"
        )
    return number


def _as_float(value: Any) -> float | None:
    """A JSON number as a float; None for anything else, and for an integer too large
    for a float (JSON allows 10**400, where float() overflows)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def flag(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidConfig(f"config field {key!r} must be true or false, got {shown(value)}")
    return value


def token_id(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidConfig(f"config field {key!r} must hold token ids, got {shown(value)}")
    return value


def bos_token_id(cfg: Mapping[str, Any]) -> int | None:
    value = cfg.get("bos_token_id")
    return None if value is None else token_id(value, "bos_token_id")


def eos_token_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    value = cfg.get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(token_id(v, "eos_token_id") for v in values)


def dtype_name(cfg: Mapping[str, Any]) -> str:
    # transformers 5 writes "dtype"; transformers 4 wrote "torch_dtype".
    value = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if isinstance(value, str):
        value = value.removeprefix("torch.")
    if not isinstance(value, str) or value not in DTYPE_BYTES:
        raise InvalidConfig(f"config dtype {shown(value)} is not one of {sorted(DTYPE_BYTES)}")
    return value


def _rope_block(cfg: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """(field name, block) of the RoPE block transformers reads, or None: transformers 5
    writes ``rope_parameters: {"rope_theta", "rope_type", ...}``; transformers 4 wrote
    ``rope_theta`` at top level plus an optional ``rope_scaling`` dict ("type" before
    4.45, "rope_type" since). As transformers 5 has it (``convert_rope_params_to_dict``),
    a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole, theta included."""
    for name in ("rope_scaling", "rope_parameters"):
        block = cfg.get(name)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise InvalidConfig(f"config field {name!r} must be an object, got {shown(block)}")
        if block:
            return name, block
    return None


def rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(base of the rotary frequencies, their scaling or None for unscaled RoPE), read
    from the block transformers uses (:func:`_rope_block`): its ``rope_theta``, else the
    top-level one, else 10000 (transformers' ``default_theta`` for every family here).
    Types other than unscaled, linear and llama3 are refused, and so is a partial rotary
    factor on a scaled type. Unscaled, the families here rotate the whole head whatever
    ``partial_rotary_factor`` says (their own default RoPE never reads it); transformers'
    linear and llama3 functions apply it (a probe's Llama config carrying 0.5, unscaled,
    was refused though transformers serves it as plain RoPE)."""
    found = _rope_block(cfg)
    name, block = found if found else ("rope_parameters", {})
    partial = block.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if block.get("rope_theta") is not None:
        theta = positive_float(block, "rope_theta", 10000.0)
    else:
        theta = positive_float(cfg, "rope_theta", 10000.0)
    rope_type = block.get("rope_type", block.get("type")) or "default"
    if rope_type == "default":
        return theta, None
    if partial is not None and partial != 1.0:
        engine_cannot_run(
            f"partial rotary embeddings (partial_rotary_factor {shown(partial)}) with "
            f"{name} type {shown(rope_type)} are not supported"
        )
    if rope_type not in ROPE_SCALING_KINDS:
        engine_cannot_run(
            f"{name} type {shown(rope_type)} is not supported; supported: default (unscaled), "
            + ", ".join(ROPE_SCALING_KINDS)
        )
        return theta, None  # read for the shape alone: as if unscaled
    return theta, _rope_scaling(cfg, name, block, rope_type)


def _rope_scaling(
    cfg: Mapping[str, Any], name: str, block: Mapping[str, Any], kind: str
) -> RopeScaling:
    """The scaling a ``kind`` block (``name``) declares (see
    :class:`~services.models.rope_scaling.RopeScaling`). A llama3 block without
    ``original_max_position_embeddings`` takes the config's ``max_position_embeddings``,
    as transformers does."""

    def number(key: str) -> float:
        try:
            return positive_float(block, key, None)
        except InvalidConfig:
            raise InvalidConfig(
                f"config field '{name}.{key}' must be a positive finite number, "
                f"got {shown(block.get(key))}"
            ) from None

    if kind == "linear":
        return RopeScaling("linear", number("factor"))
    original = block.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if (
        isinstance(original, bool)
        or not isinstance(original, int)
        or not 0 < original <= FIELD_MAXIMA["max_position_embeddings"]
    ):
        raise InvalidConfig(
            f"config field '{name}.original_max_position_embeddings' must be a positive "
            f"integer up to {FIELD_MAXIMA['max_position_embeddings']}, got {shown(original)}"
        )
    try:
        return RopeScaling(
            "llama3",
            number("factor"),
            number("low_freq_factor"),
            number("high_freq_factor"),
            original,
        )
    except ValueError as exc:
        raise InvalidConfig(f"config field {name!r}: {exc}") from None


def head_dim_of(hidden_size: int, num_heads: int) -> int:
    """hidden_size / num_heads, which must divide exactly."""
    if hidden_size % num_heads:
        raise InvalidConfig(
            f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads})"
        )
    return hidden_size // num_heads


def kv_heads_dividing(num_heads: int, num_kv_heads: int, key: str) -> int:
    """num_kv_heads, which must divide num_heads (each KV head serves a group of queries)."""
    if num_heads % num_kv_heads:
        raise InvalidConfig(
            f"num_attention_heads ({num_heads}) is not divisible by {key} ({num_kv_heads})"
        )
    return num_kv_heads


def reject_quantized(cfg: Mapping[str, Any]) -> None:
    if cfg.get("quantization_config") is not None:
        engine_cannot_run("pre-quantized checkpoints are not supported yet")
