"""GPT-J: LayerNorm, parallel residual from one ``ln_1``, partial interleaved rotary.

Attention projections ``q_proj``/``k_proj``/``v_proj``/``out_proj`` have no bias; the MLP
``fc_in``/``fc_out`` and the LM head have one. Only the first ``rotary_dim`` dimensions of
each head rotate, in pairs (x0, x1), (x2, x3), … with a fixed base of 10000. The config
uses GPT-2 names (``n_embd``, ``n_head``, ``n_layer``, ``n_positions``, ``n_inner``);
the generic names are accepted too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.models import config_fields as fields
from services.models.arch import ArchSpec, CheckpointTensor
from services.models.errors import InvalidConfig, UnsupportedArchitecture, engine_cannot_run
from services.models.families.family import ConfigRequest, Family

# transformers hard-codes GPT-J's rotary base; its config has no field for it.
GPTJ_ROPE_THETA = 10000.0
_ACTIVATIONS = ("gelu_new", "gelu")


def _int(cfg: Mapping[str, Any], keys: tuple[str, ...], default: int | None = None) -> int:
    return fields.positive_int(cfg, fields.first_present(cfg, keys), default)


def parse(cfg: Mapping[str, Any], family: str) -> ArchSpec:
    fields.reject_quantized(cfg)
    hidden_size = _int(cfg, ("n_embd", "hidden_size"))
    num_heads = _int(cfg, ("n_head", "num_attention_heads"))
    head_dim = fields.head_dim_of(hidden_size, num_heads)
    if "rotary_dim" in cfg and cfg["rotary_dim"] is None:
        engine_cannot_run("GPT-J without rotary_dim (rotary over the whole embedding)")
    rotary_dim = fields.positive_int(cfg, "rotary_dim", 64)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise InvalidConfig(
            f"rotary_dim ({rotary_dim}) must be even and at most the head size ({head_dim})"
        )
    activation = cfg.get("activation_function", "gelu_new")
    if activation not in _ACTIVATIONS:
        engine_cannot_run(
            f"GPT-J activation_function {activation!r} is not supported; "
            f"need one of {list(_ACTIVATIONS)}"
        )
        activation = _ACTIVATIONS[0]  # read for the shape alone
    if fields.flag(cfg, "tie_word_embeddings"):
        raise UnsupportedArchitecture("GPT-J with tied embeddings (and a biased LM head)")
    return ArchSpec(
        family=family,
        hidden_size=hidden_size,
        num_layers=_int(cfg, ("n_layer", "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        intermediate_size=_int(cfg, ("n_inner", "intermediate_size"), 4 * hidden_size),
        vocab_size=fields.positive_int(cfg, "vocab_size"),
        max_position_embeddings=_int(cfg, ("n_positions", "max_position_embeddings"), 2048),
        norm_eps=fields.positive_float(cfg, "layer_norm_epsilon", 1e-5),
        rope_theta=GPTJ_ROPE_THETA,
        tie_word_embeddings=False,
        torch_dtype=fields.dtype_name(cfg),
        bos_token_id=fields.bos_token_id(cfg),
        eos_token_ids=fields.eos_token_ids(cfg),
        norm_kind="layer",
        hidden_act=activation,
        gated_mlp=False,
        parallel_residual=True,
        shared_layer_norm=True,
        mlp_bias=True,
        lm_head_bias=True,
        rotary_dim=rotary_dim,
        rotary_interleaved=True,
    )


def layer_tensors(spec: ArchSpec, layer: int) -> list[CheckpointTensor]:
    hidden, inner = spec.hidden_size, spec.intermediate_size
    prefix = f"transformer.h.{layer}."
    named: list[tuple[str, str, tuple[int, ...]]] = [
        ("ln_1.weight", "attn_norm.weight", (hidden,)),
        ("ln_1.bias", "attn_norm.bias", (hidden,)),
        ("attn.k_proj.weight", "self_attn.k_proj.weight", (hidden, hidden)),
        ("attn.v_proj.weight", "self_attn.v_proj.weight", (hidden, hidden)),
        ("attn.q_proj.weight", "self_attn.q_proj.weight", (hidden, hidden)),
        ("attn.out_proj.weight", "self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.fc_in.weight", "mlp.up_proj.weight", (inner, hidden)),
        ("mlp.fc_in.bias", "mlp.up_proj.bias", (inner,)),
        ("mlp.fc_out.weight", "mlp.down_proj.weight", (hidden, inner)),
        ("mlp.fc_out.bias", "mlp.down_proj.bias", (hidden,)),
    ]
    return [
        CheckpointTensor(prefix + name, shape, ((target, None),)) for name, target, shape in named
    ]


def build_config(request: ConfigRequest) -> dict[str, Any]:
    if request.num_kv_heads != request.num_heads:
        raise InvalidConfig("GPT-J has one KV head per query head; leave num_kv_heads unset")
    if request.tie_word_embeddings:
        raise UnsupportedArchitecture("GPT-J with tied embeddings (and a biased LM head)")
    if request.rope_theta != GPTJ_ROPE_THETA:
        raise InvalidConfig(f"GPT-J's rotary base is fixed at {GPTJ_ROPE_THETA:g}")
    head_dim = fields.head_dim_of(request.hidden_size, request.num_heads)
    # GPT-J-6B rotates a quarter of each head (64 of 256).
    rotary_dim = head_dim // 4 if head_dim % 8 == 0 else head_dim
    return {
        "architectures": ["GPTJForCausalLM"],
        "model_type": "gptj",
        "n_embd": request.hidden_size,
        "n_layer": request.num_layers,
        "n_head": request.num_heads,
        "n_inner": request.intermediate_size,
        "n_positions": request.max_position_embeddings,
        "rotary_dim": rotary_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5 if request.norm_eps is None else request.norm_eps,
        "tie_word_embeddings": False,
        "torch_dtype": request.dtype,
        "vocab_size": request.vocab_size,
        "bos_token_id": request.bos_token_id,
        "eos_token_id": request.eos_token_id,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "use_cache": True,
    }


GPTJ = Family(
    name="gptj",
    model_types=("gptj",),
    architectures=("GPTJForCausalLM",),
    parse=parse,
    layer_tensors=layer_tensors,
    build_config=build_config,
    embedding="transformer.wte.weight",
    final_norm="transformer.ln_f",
    layer_count_keys=("n_layer", "num_hidden_layers"),
    harmless_suffixes=(".attn.bias", ".attn.masked_bias"),
)
