"""ArchSpec from Hugging Face configs written by transformers 4 and 5."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from services.models.arch import ArchSpec, InvalidConfig, UnsupportedArchitecture
from services.models.families import parse_config, supported_model_types
from services.models.rope_scaling import RopeScaling

# Llama-2-7B's config.json as transformers 4 wrote it.
LLAMA2_7B_TF4: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

# A Llama-3-8B-shaped config as transformers 5 writes it: "dtype", "rope_parameters".
LLAMA3_8B_TF5: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "dtype": "bfloat16",
    "eos_token_id": [128001, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def with_changes(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    config = dict(base)
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def test_transformers4_config() -> None:
    spec = parse_config(LLAMA2_7B_TF4)
    assert spec == ArchSpec(
        family="llama",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float16",
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_transformers5_config() -> None:
    spec = parse_config(LLAMA3_8B_TF5)
    assert spec.rope_theta == 500000.0
    assert spec.torch_dtype == "bfloat16"
    assert spec.eos_token_ids == (128001, 128009)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)


def test_config_written_by_installed_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        rope_theta=5000.0,
        tie_word_embeddings=True,
    ).to_dict()
    spec = parse_config(config)
    assert (spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.head_dim) == (64, 2, 2, 16)
    assert spec.rope_theta == 5000.0
    assert spec.tie_word_embeddings


def test_known_parameter_counts() -> None:
    assert parse_config(LLAMA2_7B_TF4).parameter_count() == 6_738_415_616
    assert parse_config(LLAMA3_8B_TF5).parameter_count() == 8_030_261_248


def test_weight_and_kv_bytes() -> None:
    spec = parse_config(LLAMA2_7B_TF4)
    assert spec.weight_bytes() == 2 * 6_738_415_616  # float16 by default
    assert spec.weight_bytes(4) == 4 * 6_738_415_616
    # 2 (K and V) * 32 layers * 32 kv heads * 128 * 4096 tokens * 2 bytes = 2 GiB per sequence.
    assert spec.kv_cache_bytes(4096, 1, 2) == 2 * 1024**3
    assert spec.kv_cache_bytes(1024, 3) == 3 * 2 * 1024**3 // 4
    gqa = parse_config(LLAMA3_8B_TF5)
    assert gqa.kv_cache_bytes(100, 2, 2) == 2 * 32 * 8 * 128 * 100 * 2 * 2


def test_expected_tensors_gqa_shapes() -> None:
    spec = parse_config(LLAMA3_8B_TF5)
    tensors = spec.expected_tensors()
    assert len(tensors) == 2 + 32 * 9 + 1
    assert tensors["model.embed_tokens.weight"] == (128256, 4096)
    assert tensors["model.layers.31.self_attn.q_proj.weight"] == (4096, 4096)
    assert tensors["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert tensors["model.layers.0.self_attn.v_proj.weight"] == (1024, 4096)
    assert tensors["model.layers.0.self_attn.o_proj.weight"] == (4096, 4096)
    assert tensors["model.layers.0.mlp.gate_proj.weight"] == (14336, 4096)
    assert tensors["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    assert tensors["model.layers.0.input_layernorm.weight"] == (4096,)
    assert tensors["model.layers.0.post_attention_layernorm.weight"] == (4096,)
    assert tensors["model.norm.weight"] == (4096,)
    assert tensors["lm_head.weight"] == (128256, 4096)


def test_tied_embeddings_have_no_lm_head() -> None:
    spec = parse_config(with_changes(LLAMA2_7B_TF4, tie_word_embeddings=True))
    assert "lm_head.weight" not in spec.expected_tensors()
    assert spec.parameter_count() == 6_738_415_616 - 32000 * 4096


def test_explicit_head_dim_and_biases() -> None:
    config = with_changes(
        LLAMA2_7B_TF4, head_dim=64, hidden_size=1000, attention_bias=True, mlp_bias=True
    )
    tensors = parse_config(config).expected_tensors()
    assert tensors["model.layers.0.self_attn.q_proj.weight"] == (32 * 64, 1000)
    assert tensors["model.layers.0.self_attn.o_proj.weight"] == (1000, 32 * 64)
    assert tensors["model.layers.0.self_attn.q_proj.bias"] == (32 * 64,)
    assert tensors["model.layers.0.self_attn.o_proj.bias"] == (1000,)
    assert tensors["model.layers.0.mlp.down_proj.bias"] == (1000,)


def test_defaults_for_optional_fields() -> None:
    config = with_changes(
        LLAMA2_7B_TF4,
        num_key_value_heads=...,
        torch_dtype=...,
        rope_scaling=...,
        rms_norm_eps=...,
        eos_token_id=...,
        bos_token_id=...,
    )
    spec = parse_config(config)
    assert spec.num_kv_heads == 32
    assert spec.torch_dtype == "float32"
    assert spec.norm_eps == 1e-6
    assert spec.eos_token_ids == ()
    assert spec.bos_token_id is None


def test_mistral_with_sliding_window() -> None:
    config = with_changes(
        LLAMA2_7B_TF4,
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        sliding_window=4096,
        num_key_value_heads=8,
    )
    spec = parse_config(config)
    assert (spec.family, spec.sliding_window) == ("mistral", 4096)
    assert "mistral" in supported_model_types()


def test_spec_is_frozen() -> None:
    spec = parse_config(LLAMA2_7B_TF4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
        ({"model_type": ..., "architectures": ["BertModel"]}, "BertModel"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}},
            "'yarn' is not supported; supported: default \\(unscaled\\), linear, llama3",
        ),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
    ],
)
def test_unsupported_architectures(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedArchitecture, match=message):
        parse_config(with_changes(LLAMA2_7B_TF4, **changes))


LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # transformers 4 before 4.45 ("type"), and after ("rope_type").
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, RopeScaling("linear", 2.0)),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4}}, RopeScaling("linear", 4.0)),
        # Llama 3.1 as transformers 5 writes it, and without the original context (which
        # is then the config's max_position_embeddings, as transformers takes it).
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "original_max_position_embeddings": 8192,
                    **LLAMA3_SCALING,
                }
            },
            RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}},
            RopeScaling("llama3", 8.0, 1.0, 4.0, 4096),
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, None),
        ({"rope_scaling": {"type": None}}, None),
        # Unscaled, transformers' Llama rotates the whole head whatever the factor says.
        ({"partial_rotary_factor": 0.5}, None),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, None),
    ],
)
def test_rope_scaling_is_read(changes: dict[str, Any], expected: RopeScaling | None) -> None:
    assert parse_config(with_changes(LLAMA2_7B_TF4, **changes)).rope_scaling == expected


@pytest.mark.parametrize(
    "changes",
    [
        {"partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "linear", "factor": 2}},
        {"rope_scaling": {"rope_type": "llama3", "partial_rotary_factor": 0.25, **LLAMA3_SCALING}},
    ],
)
def test_a_partial_rotary_factor_on_a_scaled_rope_is_refused(changes: dict[str, Any]) -> None:
    # transformers' linear and llama3 functions rotate only that share of the head.
    with pytest.raises(UnsupportedArchitecture, match="partial rotary embeddings"):
        parse_config(with_changes(LLAMA2_7B_TF4, **changes))


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"rope_type": "linear"}, "'rope_scaling.factor' must be a positive finite number"),
        ({"rope_type": "linear", "factor": 0}, "'rope_scaling.factor'"),
        ({"rope_type": "linear", "factor": float("inf")}, "'rope_scaling.factor'"),
        ({"rope_type": "linear", "factor": True}, "'rope_scaling.factor'"),
        ({"rope_type": "llama3", "factor": 8.0}, "'rope_scaling.low_freq_factor'"),
        (
            {**LLAMA3_SCALING, "rope_type": "llama3", "low_freq_factor": 4.0},
            "needs 0 < low_freq_factor < high_freq_factor",
        ),
        (
            {**LLAMA3_SCALING, "rope_type": "llama3", "original_max_position_embeddings": 0},
            "'rope_scaling.original_max_position_embeddings' must be a positive integer",
        ),
        (
            {**LLAMA3_SCALING, "rope_type": "llama3", "original_max_position_embeddings": "8k"},
            "original_max_position_embeddings",
        ),
    ],
)
def test_bad_rope_scaling_is_invalid_config(block: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        parse_config(with_changes(LLAMA2_7B_TF4, rope_scaling=block))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": ...}, "'hidden_size'"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers'"),
        ({"vocab_size": "32000"}, "'vocab_size'"),
        ({"intermediate_size": True}, "'intermediate_size'"),
        ({"hidden_size": 4100}, "hidden_size \\(4100\\) is not divisible"),
        ({"num_key_value_heads": 5}, "num_key_value_heads \\(5\\)"),
        ({"torch_dtype": "int8"}, "dtype 'int8'"),
        ({"eos_token_id": [2, "x"]}, "eos_token_id"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"model_type": ..., "architectures": ...}, "neither 'model_type' nor 'architectures'"),
    ],
)
def test_invalid_configs(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        parse_config(with_changes(LLAMA2_7B_TF4, **changes))


def test_an_eos_id_at_the_vocabulary_size_is_dropped(caplog) -> None:
    config = with_changes(LLAMA2_7B_TF4, eos_token_id=[2, 32000])
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        spec = parse_config(config)
    assert (spec.bos_token_id, spec.eos_token_ids) == (1, (2,))
    assert "config eos_token_id 32000 is outside the vocabulary (32000 tokens)" in caplog.text


def test_config_must_be_an_object() -> None:
    with pytest.raises(InvalidConfig, match="JSON object"):
        parse_config([1, 2])  # type: ignore[arg-type]


def test_errors_are_value_errors() -> None:
    assert issubclass(InvalidConfig, ValueError)
    assert issubclass(UnsupportedArchitecture, ValueError)


@pytest.mark.parametrize(
    ("changes", "theta", "scaling"),
    [
        # A transformers-4 rope_scaling added to a transformers-5 config (as older guides
        # extend a context): it replaces rope_parameters whole, theta included, so theta
        # is the top-level one, else 10000. iserve took rope_parameters' theta before.
        (
            {
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                "rope_scaling": {"type": "linear", "factor": 4.0},
            },
            10000.0,
            RopeScaling("linear", 4.0),
        ),
        (
            {
                "rope_theta": 2e4,
                "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            },
            2e4,
            RopeScaling("linear", 4.0),
        ),
        # An empty rope_scaling replaces nothing.
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {}},
            5e5,
            None,
        ),
    ],
)
def test_rope_blocks_take_the_precedence_transformers_gives_them(
    changes: dict[str, Any], theta: float, scaling: RopeScaling | None
) -> None:
    transformers = pytest.importorskip("transformers")
    config = with_changes(LLAMA2_7B_TF4, **changes)
    spec = parse_config(config)
    assert (spec.rope_theta, spec.rope_scaling) == (theta, scaling)
    # transformers' own reading of the same config.json.
    theirs = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert theirs.rope_parameters["rope_theta"] == theta
    assert theirs.rope_parameters.get("factor") == (scaling.factor if scaling else None)
