"""Llama, Mistral and Qwen2: RMSNorm, SwiGLU MLP, rotary (rotate-half), grouped KV heads.

The three share one checkpoint layout (``model.layers.{i}.self_attn.q_proj`` …). Llama may
put biases on all four attention projections (``attention_bias``) and on the MLP
(``mlp_bias``); Qwen2 always biases q, k and v and nothing else; Mistral adds a sliding
attention window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from services.errors import shown
from services.models import config_fields as fields
from services.models.arch import ArchSpec, CheckpointTensor
from services.models.errors import InvalidConfig, engine_cannot_run
from services.models.families.family import ConfigRequest, Family

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# What transformers' config class of each family takes for a key config.json leaves out
# (LlamaConfig, MistralConfig, Qwen2Config): a model served with another default would
# differ from it in silence (a Mistral config without sliding_window attends within 4096
# positions in transformers; read as "no window", its tokens past 4096 differed).
_CONTEXT_DEFAULT = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
_MISTRAL_WINDOW_DEFAULT = 4096
# transformers' activations that are SiLU (ACT2FN maps "swish" to nn.SiLU too).
_SILU = ("silu", "swish")


def parse(cfg: Mapping[str, Any], family: str) -> ArchSpec:
    fields.reject_quantized(cfg)
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act not in _SILU:
        engine_cannot_run(f"hidden_act {hidden_act!r} is not supported; need 'silu' (or 'swish')")
    hidden_size = fields.positive_int(cfg, "hidden_size")
    num_heads = fields.positive_int(cfg, "num_attention_heads")
    num_kv_heads = fields.kv_heads_dividing(
        num_heads,
        fields.positive_int(cfg, "num_key_value_heads", num_heads),
        "num_key_value_heads",
    )
    if cfg.get("head_dim") is None:
        head_dim = fields.head_dim_of(hidden_size, num_heads)
    else:
        head_dim = fields.positive_int(cfg, "head_dim")
    if head_dim % 2:
        raise InvalidConfig(f"head_dim ({head_dim}) must be even for rotary embeddings")
    num_layers = fields.positive_int(cfg, "num_hidden_layers")
    # transformers' per-layer attention kinds, which win over the other fields where given
    # (transformers 5 writes them into every Qwen2 and Mistral config it saves).
    kinds = _layer_types(cfg, num_layers)
    if family == "qwen2":
        # transformers gives layers from max_window_layers on a sliding window (its
        # default 28); from the last layer on, none has one.
        windowed_from = cfg.get("max_window_layers", 28)
        if (
            kinds is None
            and fields.flag(cfg, "use_sliding_window")
            and not (isinstance(windowed_from, int) and windowed_from >= num_layers)
        ):
            engine_cannot_run(
                "Qwen2 sliding-window layers (use_sliding_window: true, and "
                f"max_window_layers {windowed_from!r} below the {num_layers} layers) are "
                "not supported"
            )
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:
        attention_bias = fields.flag(cfg, "attention_bias")
        qkv_bias, out_bias = attention_bias, attention_bias
        mlp_bias = fields.flag(cfg, "mlp_bias")
    sliding_window = None
    if family == "mistral" and "sliding_window" not in cfg:
        sliding_window = _MISTRAL_WINDOW_DEFAULT
    elif (
        family == "mistral"
        and cfg["sliding_window"] is not None
        or (
            family == "qwen2"
            and kinds is not None
            and fields.flag(cfg, "use_sliding_window")
            and cfg.get("sliding_window") is not None
        )
    ):
        sliding_window = fields.positive_int(cfg, "sliding_window")
    if kinds is not None:
        sliding_window = _window_of_layers(kinds, sliding_window)
    rope_theta, rope_scaling = fields.rope(cfg)
    return ArchSpec(
        family=family,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=fields.positive_int(cfg, "intermediate_size"),
        vocab_size=fields.positive_int(cfg, "vocab_size"),
        max_position_embeddings=fields.positive_int(
            cfg, "max_position_embeddings", _CONTEXT_DEFAULT[family]
        ),
        norm_eps=fields.positive_float(cfg, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=fields.flag(cfg, "tie_word_embeddings"),
        torch_dtype=fields.dtype_name(cfg),
        bos_token_id=fields.bos_token_id(cfg),
        eos_token_ids=fields.eos_token_ids(cfg),
        qkv_bias=qkv_bias,
        attn_out_bias=out_bias,
        mlp_bias=mlp_bias,
        sliding_window=sliding_window,
    )


def layer_tensors(spec: ArchSpec, layer: int) -> list[CheckpointTensor]:
    hidden, inner = spec.hidden_size, spec.intermediate_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    prefix = f"model.layers.{layer}."
    linears = [
        ("self_attn.q_proj", (q_out, hidden), spec.qkv_bias),
        ("self_attn.k_proj", (kv_out, hidden), spec.qkv_bias),
        ("self_attn.v_proj", (kv_out, hidden), spec.qkv_bias),
        ("self_attn.o_proj", (hidden, q_out), spec.attn_out_bias),
        ("mlp.gate_proj", (inner, hidden), spec.mlp_bias),
        ("mlp.up_proj", (inner, hidden), spec.mlp_bias),
        ("mlp.down_proj", (hidden, inner), spec.mlp_bias),
    ]
    tensors = []
    for name, shape, has_bias in linears:
        tensors.append(
            CheckpointTensor(f"{prefix}{name}.weight", shape, ((f"{name}.weight", None),))
        )
        if has_bias:
            tensors.append(
                CheckpointTensor(f"{prefix}{name}.bias", shape[:1], ((f"{name}.bias", None),))
            )
    for checkpoint_norm, engine_norm in (
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "mlp_norm"),
    ):
        tensors.append(
            CheckpointTensor(
                f"{prefix}{checkpoint_norm}.weight", (hidden,), ((f"{engine_norm}.weight", None),)
            )
        )
    return tensors


def build_config(request: ConfigRequest, family: str) -> dict[str, Any]:
    intermediate = request.intermediate_size
    if intermediate is None:
        # Llama's 8/3 expansion, rounded up to a multiple of 32.
        intermediate = 32 * math.ceil(8 * request.hidden_size / 3 / 32)
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": request.hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": request.num_layers,
        "num_attention_heads": request.num_heads,
        "num_key_value_heads": request.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": request.max_position_embeddings,
        "rms_norm_eps": 1e-6 if request.norm_eps is None else request.norm_eps,
        "rope_theta": request.rope_theta,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": request.tie_word_embeddings,
        "torch_dtype": request.dtype,
        "vocab_size": request.vocab_size,
        "bos_token_id": request.bos_token_id,
        "eos_token_id": request.eos_token_id,
        "use_cache": True,
    }
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif family == "mistral":
        config["sliding_window"] = request.sliding_window
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
    return config


def _family(name: str) -> Family:
    return Family(
        name=name,
        model_types=(name,),
        architectures=(_ARCHITECTURES[name],),
        parse=parse,
        layer_tensors=layer_tensors,
        build_config=lambda request: build_config(request, name),
        embedding="model.embed_tokens.weight",
        final_norm="model.norm",
    )


LLAMA = _family("llama")
MISTRAL = _family("mistral")
QWEN2 = _family("qwen2")


_FULL, _SLIDING = "full_attention", "sliding_attention"


def _layer_types(cfg: dict, num_layers: int) -> list[str] | None:
    """``layer_types`` (one attention kind per layer), None when the config has none.
    InvalidConfig when it is no list of one kind per layer; a kind other than full or
    sliding attention is one the engine cannot run."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise InvalidConfig(
            f"layer_types must list one attention kind per layer ({num_layers}), got {shown(kinds)}"
        )
    others = sorted({str(k) for k in kinds} - {_FULL, _SLIDING})
    if others:
        engine_cannot_run(
            f"layer_types {others} (attention other than full or sliding) is not supported"
        )
    return kinds


def _window_of_layers(kinds: list[str], window: int | None) -> int | None:
    """The one sliding window of every layer, as ``layer_types`` says: none where all
    attend fully (whatever sliding_window says); ``window`` where all slide. Layers of
    both kinds are a model the engine cannot run (one window for every layer): served,
    its tokens would differ from transformers' in silence."""
    sliding = [i for i, kind in enumerate(kinds) if kind == _SLIDING]
    if not sliding:
        return None
    if window is None:
        raise InvalidConfig(
            f"layer_types gives layers {sliding} sliding-window attention, but the config "
            "sets no sliding_window (with use_sliding_window: true for Qwen2)"
        )
    if len(sliding) < len(kinds):
        engine_cannot_run(
            f"layers of both attention kinds (layer_types: layers {sliding} on a sliding "
            "window, the others full) are not supported"
        )
    return window
