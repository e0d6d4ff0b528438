"""Qwen2, Falcon and GPT-J configs; tensor layouts; pipeline-stage weight plans."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from services.models.arch import InvalidConfig, UnsupportedArchitecture, WeightSource
from services.models.families import config_with_layers, parse_config, supported_model_types
from services.models.families.falcon import fused_qkv_rows
from services.models.presets import PRESETS

FALCON_7B = dict(PRESETS["falcon-7b"].config)
FALCON_40B = dict(PRESETS["falcon-40b"].config)
GPTJ_6B = dict(PRESETS["gpt-j-6b"].config)
QWEN2_7B = dict(PRESETS["qwen2-7b"].config)


def with_changes(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    config = dict(base)
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def test_family_names_match_the_registry() -> None:
    assert supported_model_types() == ["falcon", "gptj", "llama", "mistral", "qwen2"]
    families = {parse_config(p.config).family for p in PRESETS.values()}
    assert families == {"llama", "mistral", "qwen2", "falcon", "gptj"}


def test_defaults_of_keys_a_config_leaves_out_are_transformers_own() -> None:
    """MistralConfig attends within 4096 positions and takes 131072, Qwen2Config 32768,
    LlamaConfig 2048, when config.json does not say: a Mistral config without
    sliding_window was served without a window, its tokens past 4096 not transformers'."""
    mistral = dict(PRESETS["mistral-7b"].config)
    for key in ("sliding_window", "max_position_embeddings"):
        mistral.pop(key)
    spec = parse_config(mistral)
    assert (spec.sliding_window, spec.max_position_embeddings) == (4096, 131072)
    assert parse_config({**mistral, "sliding_window": None}).sliding_window is None
    qwen = with_changes(QWEN2_7B, max_position_embeddings=...)
    assert parse_config(qwen).max_position_embeddings == 32768
    llama = with_changes(dict(PRESETS["llama-2-7b"].config), max_position_embeddings=...)
    assert parse_config(llama).max_position_embeddings == 2048


def test_qwen2_sliding_windows_from_past_the_last_layer_are_no_windows() -> None:
    """transformers windows the layers from max_window_layers on (default 28): from the
    last layer on, every layer attends in full, as served."""
    layers = QWEN2_7B["num_hidden_layers"]
    for from_layer in (layers, layers + 10):
        spec = parse_config(
            with_changes(QWEN2_7B, use_sliding_window=True, max_window_layers=from_layer)
        )
        assert spec.sliding_window is None
    with pytest.raises(UnsupportedArchitecture, match="max_window_layers 27 below the 28"):
        parse_config(with_changes(QWEN2_7B, use_sliding_window=True, max_window_layers=27))


def test_layer_types_decide_the_window_as_in_transformers() -> None:
    """transformers gives each layer the attention ``layer_types`` names (it writes the
    list into every Qwen2 and Mistral config it saves), over sliding_window and
    max_window_layers: a Mistral listed all full was served windowed, a Qwen2 listing
    sliding layers served without a window, each in silence (a probe's tokens differed)."""
    layers = QWEN2_7B["num_hidden_layers"]
    mistral = {**dict(PRESETS["mistral-7b"].config), "sliding_window": 6}
    n = mistral["num_hidden_layers"]
    assert parse_config({**mistral, "layer_types": ["full_attention"] * n}).sliding_window is None
    windowed = parse_config({**mistral, "layer_types": ["sliding_attention"] * n})
    assert windowed.sliding_window == 6
    mixed = ["full_attention", "sliding_attention"] * (n // 2)
    with pytest.raises(UnsupportedArchitecture, match="layers of both attention kinds"):
        parse_config({**mistral, "layer_types": mixed})
    qwen = with_changes(QWEN2_7B, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    assert parse_config({**qwen, "layer_types": ["full_attention"] * layers}).sliding_window is None
    assert parse_config({**qwen, "layer_types": ["sliding_attention"] * layers}).sliding_window == 6
    with pytest.raises(UnsupportedArchitecture, match="layers of both attention kinds"):
        parse_config(
            {**qwen, "layer_types": ["sliding_attention"] * 2 + ["full_attention"] * (layers - 2)}
        )
    unwindowed = with_changes(QWEN2_7B, use_sliding_window=False)
    with pytest.raises(InvalidConfig, match="sets no sliding_window"):
        parse_config({**unwindowed, "layer_types": ["sliding_attention"] * layers})
    with pytest.raises(InvalidConfig, match="one attention kind per layer"):
        parse_config({**qwen, "layer_types": ["full_attention"]})
    with pytest.raises(UnsupportedArchitecture, match="chunked_attention"):
        parse_config({**qwen, "layer_types": ["chunked_attention"] * layers})


def test_swish_is_silu_as_transformers_reads_it() -> None:
    assert parse_config(with_changes(QWEN2_7B, hidden_act="swish")).family == "qwen2"


def test_qwen2_biases_only_query_key_value() -> None:
    spec = parse_config(QWEN2_7B)
    assert (spec.qkv_bias, spec.attn_out_bias, spec.mlp_bias) == (True, False, False)
    assert (spec.num_kv_heads, spec.head_dim, spec.rope_theta) == (4, 128, 1e6)
    tensors = spec.expected_tensors()
    assert tensors["model.layers.0.self_attn.q_proj.bias"] == (3584,)
    assert tensors["model.layers.0.self_attn.k_proj.bias"] == (512,)
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert spec.sliding_window is None


def test_falcon_7b_is_multi_query_with_one_shared_norm() -> None:
    spec = parse_config(FALCON_7B)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (71, 1, 64)
    assert (spec.norm_kind, spec.hidden_act, spec.gated_mlp) == ("layer", "gelu", False)
    assert spec.parallel_residual and spec.shared_layer_norm and spec.tie_word_embeddings
    assert spec.intermediate_size == 4 * 4544
    layer = {
        name.removeprefix("transformer.h.0."): shape
        for name, shape in spec.expected_tensors().items()
        if name.startswith("transformer.h.0.")
    }
    assert layer == {
        "self_attention.query_key_value.weight": ((71 + 2) * 64, 4544),
        "self_attention.dense.weight": (4544, 4544),
        "mlp.dense_h_to_4h.weight": (18176, 4544),
        "mlp.dense_4h_to_h.weight": (4544, 18176),
        "input_layernorm.weight": (4544,),
        "input_layernorm.bias": (4544,),
    }
    assert "lm_head.weight" not in spec.expected_tensors()
    assert spec.expected_tensors()["transformer.ln_f.bias"] == (4544,)


def test_falcon_40b_groups_kv_heads_with_two_norms() -> None:
    spec = parse_config(FALCON_40B)
    assert (spec.num_heads, spec.num_kv_heads) == (128, 8)
    assert spec.parallel_residual and not spec.shared_layer_norm
    tensors = spec.expected_tensors()
    assert tensors["transformer.h.59.self_attention.query_key_value.weight"] == (9216, 8192)
    assert {"transformer.h.0.ln_attn.weight", "transformer.h.0.ln_mlp.bias"} <= set(tensors)
    assert "transformer.h.0.input_layernorm.weight" not in tensors


def test_falcon_variants() -> None:
    one_norm = parse_config(with_changes(FALCON_40B, num_ln_in_parallel_attn=1))
    assert one_norm.shared_layer_norm
    assert "transformer.h.0.input_layernorm.weight" in one_norm.expected_tensors()
    sequential = parse_config(
        with_changes(FALCON_7B, multi_query=False, parallel_attn=False, bias=True)
    )
    assert sequential.num_kv_heads == 71 and not sequential.parallel_residual
    tensors = sequential.expected_tensors()
    assert "transformer.h.0.post_attention_layernorm.bias" in tensors
    assert tensors["transformer.h.0.self_attention.query_key_value.bias"] == (3 * 4544,)
    assert tensors["transformer.h.0.mlp.dense_4h_to_h.bias"] == (4544,)


def test_fused_qkv_rows_follow_the_kv_groups() -> None:
    # 4 query heads in 2 groups of 2, head_dim 2: [q0 q1 k0 v0 | q2 q3 k1 v1].
    assert fused_qkv_rows(4, 2, 2) == (((0, 4), (8, 12)), ((4, 6), (12, 14)), ((6, 8), (14, 16)))
    # Multi-query: all queries, then the key, then the value.
    assert fused_qkv_rows(3, 1, 2) == (((0, 6),), ((6, 8),), ((8, 10),))
    # One KV head per query head: [q k v] per head.
    assert fused_qkv_rows(2, 2, 1) == (((0, 1), (3, 4)), ((1, 2), (4, 5)), ((2, 3), (5, 6)))


def test_gptj_partial_interleaved_rotary_and_biases() -> None:
    spec = parse_config(GPTJ_6B)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.head_dim) == (4096, 28, 16, 256)
    assert (spec.rotary_dim, spec.rotary_interleaved, spec.rope_theta) == (64, True, 10000.0)
    assert (spec.hidden_act, spec.intermediate_size) == ("gelu_new", 16384)
    assert spec.lm_head_bias and spec.mlp_bias and not spec.qkv_bias
    tensors = spec.expected_tensors()
    assert tensors["transformer.wte.weight"] == (50400, 4096)
    assert tensors["transformer.h.27.mlp.fc_in.bias"] == (16384,)
    assert tensors["lm_head.bias"] == (50400,)
    assert "transformer.h.0.attn.q_proj.bias" not in tensors


def test_gptj_generic_field_names() -> None:
    generic = with_changes(
        GPTJ_6B,
        n_embd=...,
        n_head=...,
        n_layer=...,
        hidden_size=4096,
        num_attention_heads=16,
        num_hidden_layers=2,
    )
    spec = parse_config(generic)
    assert (spec.hidden_size, spec.num_heads, spec.num_layers) == (4096, 16, 2)


def test_rotary_dim_defaults_to_the_whole_head() -> None:
    spec = parse_config(PRESETS["llama-2-7b"].config)
    assert spec.rotary_dim == spec.head_dim == 128 and not spec.rotary_interleaved


@pytest.mark.parametrize(
    ("base", "changes", "message"),
    [
        (FALCON_7B, {"alibi": True}, "ALiBi"),
        (FALCON_40B, {"parallel_attn": False}, "parallel_attn"),
        (FALCON_7B, {"num_ln_in_parallel_attn": 2}, "new_decoder_architecture"),
        (FALCON_7B, {"activation": "relu"}, "relu"),
        (FALCON_7B, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        (GPTJ_6B, {"tie_word_embeddings": True}, "tied"),
        (GPTJ_6B, {"rotary_dim": None}, "rotary_dim"),
        (GPTJ_6B, {"activation_function": "relu"}, "relu"),
        (QWEN2_7B, {"use_sliding_window": True, "max_window_layers": 4}, "use_sliding_window"),
        (QWEN2_7B, {"hidden_act": "gelu"}, "hidden_act"),
        (QWEN2_7B, {"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ],
)
def test_unsupported_family_features(base, changes, message) -> None:
    with pytest.raises(UnsupportedArchitecture, match=message):
        parse_config(with_changes(base, **changes))


@pytest.mark.parametrize(
    ("base", "changes", "message"),
    [
        (FALCON_40B, {"num_kv_heads": 7}, "num_kv_heads \\(7\\)"),
        (FALCON_7B, {"multi_query": False, "num_kv_heads": 8}, "must equal"),
        (FALCON_7B, {"hidden_size": 4545}, "not divisible"),
        (FALCON_7B, {"num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn"),
        (FALCON_7B, {"layer_norm_epsilon": 0}, "layer_norm_epsilon"),
        (GPTJ_6B, {"rotary_dim": 7}, "rotary_dim \\(7\\)"),
        (GPTJ_6B, {"rotary_dim": 512}, "at most the head size"),
        (GPTJ_6B, {"n_embd": ...}, "'n_embd'"),
        (QWEN2_7B, {"num_key_value_heads": 5}, "num_key_value_heads \\(5\\)"),
    ],
)
def test_invalid_family_configs(base, changes, message) -> None:
    with pytest.raises(InvalidConfig, match=message):
        parse_config(with_changes(base, **changes))


def test_special_token_ids_outside_the_vocabulary_are_dropped(caplog) -> None:
    # Hugging Face's GPT-J config carries 50256 whatever the vocabulary; transformers loads it.
    tiny_gptj = with_changes(GPTJ_6B, vocab_size=320)
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        spec = parse_config(tiny_gptj)
    assert (spec.bos_token_id, spec.eos_token_ids) == (None, ())
    assert [r.getMessage() for r in caplog.records] == [
        "config bos_token_id 50256 is outside the vocabulary (320 tokens); ignoring it",
        "config eos_token_id 50256 is outside the vocabulary (320 tokens); ignoring it",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        spec = parse_config(with_changes(FALCON_7B, eos_token_id=[11, 70000]))
    assert (spec.bos_token_id, spec.eos_token_ids) == (11, (11,))
    assert "eos_token_id 70000 is outside the vocabulary" in caplog.text


@pytest.mark.parametrize("model_type", ["qwen2", "falcon", "gptj"])
def test_config_written_by_installed_transformers(model_type: str) -> None:
    """Default configs of transformers' own classes parse, and the tensors ArchSpec expects
    are exactly the state dict transformers builds from them."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    small = {
        "qwen2": {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "falcon": {"hidden_size": 64, "num_attention_heads": 4, "bias": True},
        "gptj": {"n_embd": 64, "n_head": 4, "rotary_dim": 8},
    }[model_type]
    config = transformers.AutoConfig.for_model(
        model_type, num_hidden_layers=2, vocab_size=100, bos_token_id=1, eos_token_id=2, **small
    )
    spec = parse_config(config.to_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf_tensors = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if spec.tie_word_embeddings:
        hf_tensors.pop("lm_head.weight", None)
    assert spec.expected_tensors() == hf_tensors
    assert spec.parameter_count() == model.num_parameters()


def test_stage_weights_partition_the_checkpoint() -> None:
    spec = parse_config(config_with_layers(FALCON_40B, 4))
    stages = [spec.stage_weights(0, 1), spec.stage_weights(1, 2), spec.stage_weights(3, 1)]
    first, middle, last = stages
    assert "embed_tokens.weight" in first and "norm.weight" not in first
    assert not any(name.startswith(("embed_tokens", "norm", "lm_head")) for name in middle)
    assert middle["layers.1.self_attn.q_proj.weight"].tensor == (
        "transformer.h.2.self_attention.query_key_value.weight"
    )
    # Falcon-40B is tied: the last stage reads its own LM head from the embedding.
    assert last["lm_head.weight"] == WeightSource("transformer.word_embeddings.weight")
    read = {source.tensor for stage in stages for source in stage.values()}
    assert read == set(spec.expected_tensors())
    whole = spec.stage_weights()
    assert "lm_head.weight" not in whole  # the tied head reuses the stage's embedding


def test_stage_weights_split_the_fused_projection() -> None:
    spec = parse_config(config_with_layers(FALCON_7B, 1))
    weights = spec.stage_weights()
    fused = "transformer.h.0.self_attention.query_key_value.weight"
    assert weights["layers.0.self_attn.q_proj.weight"] == WeightSource(fused, ((0, 71 * 64),))
    assert weights["layers.0.self_attn.k_proj.weight"] == WeightSource(fused, ((71 * 64, 72 * 64),))
    assert weights["layers.0.self_attn.v_proj.weight"] == WeightSource(fused, ((72 * 64, 73 * 64),))
    assert (
        weights["layers.0.mlp.up_proj.weight"].tensor == "transformer.h.0.mlp.dense_h_to_4h.weight"
    )
    assert weights["layers.0.attn_norm.bias"].tensor == "transformer.h.0.input_layernorm.bias"


@pytest.mark.parametrize(
    ("first", "count", "message"),
    [(-1, 1, "first_layer"), (4, 1, "first_layer"), (1, 0, "layer_count"), (2, 3, "layer_count")],
)
def test_bad_stages_are_rejected(first: int, count: int, message: str) -> None:
    spec = parse_config(config_with_layers(FALCON_7B, 4))
    with pytest.raises(ValueError, match=message):
        spec.stage_weights(first, count)


def test_config_with_layers_knows_each_family() -> None:
    assert config_with_layers(GPTJ_6B, 2)["n_layer"] == 2
    assert "num_hidden_layers" not in config_with_layers(GPTJ_6B, 2)
    assert config_with_layers(FALCON_40B, 3)["num_hidden_layers"] == 3
    qwen = with_changes(QWEN2_7B, layer_types=["full_attention"] * 28)
    assert config_with_layers(qwen, 2)["layer_types"] == ["full_attention"] * 2
    assert parse_config(config_with_layers(GPTJ_6B, 2)).num_layers == 2
    with pytest.raises(ValueError, match="num_layers"):
        config_with_layers(GPTJ_6B, 0)


def test_gptj_mask_buffers_are_ignorable() -> None:
    spec = parse_config(GPTJ_6B)
    assert spec.is_ignorable_tensor("transformer.h.0.attn.masked_bias")
    assert spec.is_ignorable_tensor("transformer.h.0.attn.bias")
    assert not spec.is_ignorable_tensor("transformer.h.0.mlp.fc_in.bias")


@pytest.mark.parametrize(
    ("family", "config_class"),
    [("llama", "LlamaConfig"), ("mistral", "MistralConfig"), ("qwen2", "Qwen2Config")],
)
def test_the_defaults_are_those_of_transformers_config_classes(family, config_class) -> None:
    """Asked of transformers itself: what its config class takes for the keys a minimal
    config.json leaves out is what iserve takes."""
    transformers = pytest.importorskip("transformers")
    theirs = getattr(transformers, config_class)()
    minimal = {
        "model_type": family,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    ours = parse_config(minimal)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.norm_eps == theirs.rms_norm_eps
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    window = getattr(theirs, "sliding_window", None)
    if family == "qwen2":  # windowed only with use_sliding_window, off by default
        window = window if theirs.use_sliding_window else None
    assert ours.sliding_window == window
