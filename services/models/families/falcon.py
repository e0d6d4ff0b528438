"""Falcon: LayerNorm, GELU MLP, rotary (rotate-half), fused ``query_key_value``.

Two decoder designs share ``model_type`` "falcon":

* the original (Falcon-7B, ``new_decoder_architecture: false``): multi-query attention (one
  KV head) when ``multi_query`` (the default), otherwise one KV head per query head;
  attention and MLP in parallel from one ``input_layernorm`` when ``parallel_attn`` (the
  default), otherwise sequential with a ``post_attention_layernorm``;
* the new one (Falcon-40B, ``new_decoder_architecture: true``): ``num_kv_heads`` grouped KV
  heads, always parallel, with separate ``ln_attn`` and ``ln_mlp`` (or one
  ``input_layernorm`` when ``num_ln_in_parallel_attn`` is 1).

The fused projection is laid out per KV group: for each group its query heads, then its
key head, then its value head. That one rule describes every variant (the original
multi-query layout is one group; one KV head per query head is groups of one), so the
engine splits it into separate q/k/v projections at load time by rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.models import config_fields as fields
from services.models.arch import ArchSpec, CheckpointTensor, RowRanges
from services.models.errors import InvalidConfig, UnsupportedArchitecture, engine_cannot_run
from services.models.families.family import ConfigRequest, Family

_ACTIVATIONS = ("gelu", "gelu_new")


def parse(cfg: Mapping[str, Any], family: str) -> ArchSpec:
    fields.reject_quantized(cfg)
    if fields.flag(cfg, "alibi"):
        engine_cannot_run("Falcon with ALiBi positions (alibi: true) is not supported")
    hidden_size = fields.positive_int(cfg, "hidden_size")
    num_heads = fields.positive_int(cfg, "num_attention_heads")
    head_dim = fields.head_dim_of(hidden_size, num_heads)
    if head_dim % 2:
        raise InvalidConfig(f"head_dim ({head_dim}) must be even for rotary embeddings")
    parallel = fields.flag(cfg, "parallel_attn", True)
    norms_in_parallel = cfg.get("num_ln_in_parallel_attn")
    if norms_in_parallel not in (None, 1, 2):
        raise InvalidConfig(
            f"config field 'num_ln_in_parallel_attn' must be 1 or 2, got {norms_in_parallel!r}"
        )
    if fields.flag(cfg, "new_decoder_architecture"):
        num_kv_heads = fields.kv_heads_dividing(
            num_heads, fields.positive_int(cfg, "num_kv_heads", num_heads), "num_kv_heads"
        )
        if not parallel:
            raise UnsupportedArchitecture(
                "Falcon's new_decoder_architecture with parallel_attn: false cannot be run "
                "(transformers cannot either)"
            )
        shared_norm = norms_in_parallel == 1
    else:
        if fields.flag(cfg, "multi_query", True):
            num_kv_heads = 1
        else:
            num_kv_heads = fields.positive_int(cfg, "num_kv_heads", num_heads)
            if num_kv_heads != num_heads:
                raise InvalidConfig(
                    f"num_kv_heads ({num_kv_heads}) must equal num_attention_heads "
                    f"({num_heads}) without multi_query or new_decoder_architecture"
                )
        if parallel and norms_in_parallel == 2:
            raise UnsupportedArchitecture(
                "num_ln_in_parallel_attn: 2 needs new_decoder_architecture: true"
            )
        shared_norm = parallel
    activation = cfg.get("activation", "gelu")
    if activation not in _ACTIVATIONS:
        engine_cannot_run(
            f"Falcon activation {activation!r} is not supported; need one of {list(_ACTIVATIONS)}"
        )
        activation = _ACTIVATIONS[0]  # read for the shape alone
    bias = fields.flag(cfg, "bias")
    rope_theta, rope_scaling = fields.rope(cfg)
    return ArchSpec(
        family=family,
        hidden_size=hidden_size,
        num_layers=fields.positive_int(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=fields.positive_int(cfg, "ffn_hidden_size", 4 * hidden_size),
        vocab_size=fields.positive_int(cfg, "vocab_size"),
        max_position_embeddings=fields.positive_int(cfg, "max_position_embeddings", 2048),
        norm_eps=fields.positive_float(cfg, "layer_norm_epsilon", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        # FalconConfig ties the LM head to the embeddings unless told otherwise.
        tie_word_embeddings=fields.flag(cfg, "tie_word_embeddings", True),
        torch_dtype=fields.dtype_name(cfg),
        bos_token_id=fields.bos_token_id(cfg),
        eos_token_ids=fields.eos_token_ids(cfg),
        norm_kind="layer",
        hidden_act=activation,
        gated_mlp=False,
        parallel_residual=parallel,
        shared_layer_norm=shared_norm,
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=bias,
    )


def fused_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[RowRanges, ...]:
    """Rows of the fused projection holding the queries, keys and values (in that order)."""
    group = num_heads // num_kv_heads
    block = (group + 2) * head_dim
    queries = [(g * block, g * block + group * head_dim) for g in range(num_kv_heads)]
    keys = [(start + group * head_dim, start + (group + 1) * head_dim) for start, _ in queries]
    values = [(start + head_dim, stop + head_dim) for start, stop in keys]
    return _merged(queries), _merged(keys), _merged(values)


def _merged(ranges: list[tuple[int, int]]) -> RowRanges:
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


def layer_tensors(spec: ArchSpec, layer: int) -> list[CheckpointTensor]:
    hidden, inner, head_dim = spec.hidden_size, spec.intermediate_size, spec.head_dim
    prefix = f"transformer.h.{layer}."
    rows = fused_qkv_rows(spec.num_heads, spec.num_kv_heads, head_dim)
    fused_out = (spec.num_heads + 2 * spec.num_kv_heads) * head_dim

    def split(kind: str) -> tuple[tuple[str, RowRanges | None], ...]:
        names = ("q_proj", "k_proj", "v_proj")
        return tuple((f"self_attn.{name}.{kind}", r) for name, r in zip(names, rows, strict=True))

    fused = f"{prefix}self_attention.query_key_value"
    tensors = [CheckpointTensor(f"{fused}.weight", (fused_out, hidden), split("weight"))]
    if spec.qkv_bias:
        tensors.append(CheckpointTensor(f"{fused}.bias", (fused_out,), split("bias")))
    for checkpoint_name, engine_name, shape, has_bias in (
        ("self_attention.dense", "self_attn.o_proj", (hidden, hidden), spec.attn_out_bias),
        ("mlp.dense_h_to_4h", "mlp.up_proj", (inner, hidden), spec.mlp_bias),
        ("mlp.dense_4h_to_h", "mlp.down_proj", (hidden, inner), spec.mlp_bias),
    ):
        names = [("weight", shape)] + ([("bias", shape[:1])] if has_bias else [])
        for kind, tensor_shape in names:
            tensors.append(
                CheckpointTensor(
                    f"{prefix}{checkpoint_name}.{kind}",
                    tensor_shape,
                    ((f"{engine_name}.{kind}", None),),
                )
            )
    if spec.shared_layer_norm:
        norms = [("input_layernorm", "attn_norm")]
    elif spec.parallel_residual:
        norms = [("ln_attn", "attn_norm"), ("ln_mlp", "mlp_norm")]
    else:
        norms = [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")]
    for checkpoint_norm, engine_norm in norms:
        for kind in ("weight", "bias"):
            tensors.append(
                CheckpointTensor(
                    f"{prefix}{checkpoint_norm}.{kind}",
                    (hidden,),
                    ((f"{engine_norm}.{kind}", None),),
                )
            )
    return tensors


def build_config(request: ConfigRequest) -> dict[str, Any]:
    heads, kv_heads = request.num_heads, request.num_kv_heads
    # One KV head is Falcon-7B's multi-query design and one per query head the original
    # multi-head one; anything in between needs Falcon-40B's grouped design.
    new_architecture = kv_heads not in (1, heads)
    return {
        "architectures": ["FalconForCausalLM"],
        "model_type": "falcon",
        "hidden_size": request.hidden_size,
        "num_hidden_layers": request.num_layers,
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "new_decoder_architecture": new_architecture,
        "multi_query": kv_heads == 1,
        "parallel_attn": True,
        "alibi": False,
        "bias": False,
        "ffn_hidden_size": request.intermediate_size or 4 * request.hidden_size,
        "activation": "gelu",
        "layer_norm_epsilon": 1e-5 if request.norm_eps is None else request.norm_eps,
        "max_position_embeddings": request.max_position_embeddings,
        "rope_theta": request.rope_theta,
        "tie_word_embeddings": request.tie_word_embeddings,
        "torch_dtype": request.dtype,
        "vocab_size": request.vocab_size,
        "bos_token_id": request.bos_token_id,
        "eos_token_id": request.eos_token_id,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "use_cache": True,
    }


FALCON = Family(
    name="falcon",
    model_types=("falcon",),
    architectures=("FalconForCausalLM",),
    parse=parse,
    layer_tensors=layer_tensors,
    build_config=build_config,
    embedding="transformer.word_embeddings.weight",
    final_norm="transformer.ln_f",
)
