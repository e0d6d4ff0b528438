"""config.json values of the wrong type, out of range or missing: InvalidConfig (or
UnsupportedArchitecture) naming the field, which registration reports as
INVALID_ARGUMENT; never a TypeError, an overflow or a config too large to enumerate."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fingerprint_svc.registry import inspect_checkpoint
from services.errors import InvalidArgument
from services.models.checkpoint import create_checkpoint
from services.models.config_fields import FIELD_MAXIMA
from services.models.errors import InvalidConfig, UnsupportedArchitecture
from services.models.families import FAMILIES, ConfigRequest, parse_config

REQUEST = ConfigRequest(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    dtype="float32",
    rope_theta=10000.0,
    norm_eps=None,
    sliding_window=None,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    name: family.build_config(
        replace(REQUEST, num_kv_heads=REQUEST.num_heads) if name == "gptj" else REQUEST
    )
    for name, family in FAMILIES.items()
}
LLAMA = CONFIGS["llama"]


def _refused(config: dict) -> str:
    with pytest.raises((InvalidConfig, UnsupportedArchitecture)) as err:
        parse_config(config)
    return str(err.value)


@pytest.mark.parametrize(
    "value",
    ["32", 2.0, 2.5, True, None, [2], {"n": 2}, 0, -1, 10**12, 2**64, 10**400],
    ids=repr,
)
@pytest.mark.parametrize(
    "field",
    ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"],
)
def test_a_count_of_the_wrong_type_or_range_names_the_field(field, value):
    message = _refused({**LLAMA, field: value})
    assert repr(field) in message, message


def test_missing_required_fields_are_named():
    for field in ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"]:
        config = {k: v for k, v in LLAMA.items() if k != field}
        message = _refused(config)
        assert f"missing required field {field!r}" in message


def test_shapes_that_contradict_each_other_are_named():
    assert "not divisible by num_attention_heads" in _refused(
        {**LLAMA, "num_attention_heads": 3, "num_key_value_heads": 3}
    )
    assert "num_key_value_heads" in _refused({**LLAMA, "num_key_value_heads": 3})


def test_absurd_sizes_are_refused_before_anything_is_enumerated():
    """10^12 layers would make the expected-tensor list 10^13 names long."""
    message = _refused({**LLAMA, "num_hidden_layers": 10**12})
    assert "num_hidden_layers" in message and str(FIELD_MAXIMA["num_hidden_layers"]) in message
    for field, limit in FIELD_MAXIMA.items():
        if field in LLAMA:
            assert field in _refused({**LLAMA, field: limit + 1})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1e-6, "1e-6", [1e-6]])
def test_a_non_finite_or_non_positive_float_names_the_field(value):
    assert "'rms_norm_eps'" in _refused({**LLAMA, "rms_norm_eps": value})


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"rms_norm_eps": 10**400}, "'rms_norm_eps'"),
        ({"rope_theta": 10**400}, "'rope_theta'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10**400}}, "'rope_theta'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 10**400}}, "'rope_scaling.factor'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 10**400}},
            "'rope_scaling.low_freq_factor'",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 10**400,
                }
            },
            "'rope_scaling.original_max_position_embeddings'",
        ),
        ({"max_position_embeddings": 10**400}, "'max_position_embeddings'"),
        ({"vocab_size": -(10**400)}, "'vocab_size'"),
    ],
)
def test_an_integer_no_float_holds_is_refused_by_name_and_shown_cut(changes, field):
    """JSON allows 10**400 in any number field: a float field overflows float(); an
    integer field would echo all 401 digits."""
    message = _refused({**LLAMA, **changes})
    assert field in message, message
    assert len(message) < 200, message


@pytest.mark.parametrize("value", [["float32"], {"float": 32}, 32, "float8", "torch.int8"])
def test_an_unknown_or_mistyped_dtype_is_named(value):
    assert "dtype" in _refused({**LLAMA, "torch_dtype": value, "dtype": value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_type", ["llama"]),
        ("model_type", {"llama": 1}),
        ("architectures", "LlamaForCausalLM"),
        ("architectures", [["LlamaForCausalLM"]]),
        ("tie_word_embeddings", "yes"),
        ("eos_token_id", [[2]]),
        ("bos_token_id", -1),
        ("rope_scaling", "linear"),
        ("hidden_act", ["silu"]),
        ("quantization_config", {"quant_method": "gptq"}),
    ],
)
def test_other_fields_of_the_wrong_type_are_refused(field, value):
    message = _refused({**LLAMA, field: value})
    assert field.split("_")[0] in message or "quantized" in message, message


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", "1"), ("rms_norm_eps", 10**400)],
    ids=["string-count", "huge-int-float"],
)
def test_registration_reports_a_bad_config_as_invalid_argument(tmp_path, field, value):
    directory = create_checkpoint(
        tmp_path / "bad", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    config = json.loads((directory / "config.json").read_text())
    config[field] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument) as err:
        inspect_checkpoint(directory, "checkpoint 'bad'")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"checkpoint 'bad': config field {field!r}" in str(err.value), str(err.value)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**66), 2**66)
    | st.floats()
    | st.text(max_size=10)
    | st.sampled_from(["llama", "falcon", "gptj", "float16", "default", "linear"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(sorted(CONFIGS)),
    st.dictionaries(
        st.sampled_from(sorted({key for config in CONFIGS.values() for key in config})),
        _json_values,
        max_size=4,
    ),
)
def test_any_mutated_config_parses_or_is_refused_by_name(family, changes):
    """A valid config of each family with up to four fields set to arbitrary JSON values
    parses, or fails with InvalidConfig / UnsupportedArchitecture; nothing else escapes."""
    try:
        spec = parse_config({**CONFIGS[family], **changes})
    except (InvalidConfig, UnsupportedArchitecture):
        return
    assert 1 <= spec.num_layers <= FIELD_MAXIMA["num_hidden_layers"]
    assert 0 < spec.hidden_size <= FIELD_MAXIMA["hidden_size"]
    assert math.isfinite(spec.norm_eps) and math.isfinite(spec.rope_theta)
