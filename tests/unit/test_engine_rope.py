"""The engine's rotary frequencies against transformers' own (ROPE_INIT_FUNCTIONS), the
library whose checkpoints declare them: unscaled, linear and llama3 scaling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor_agent.engine.rope import inverse_frequencies, rope_tables
from services.models.rope_scaling import RopeScaling

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402


def _transformers_inv_freq(head_dim: int, theta: float, parameters: dict) -> torch.Tensor:
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=1 << 20,
        rope_parameters={"rope_theta": theta, **parameters},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu")
    assert attention_factor == 1.0  # neither scaling rescales cos and sin
    return inv_freq


@settings(max_examples=60, deadline=None)
@given(
    head_dim=st.sampled_from([16, 64, 128]),
    theta=st.sampled_from([10_000.0, 500_000.0, 1_000_000.0]),
    factor=st.floats(1.0, 64.0),
    low=st.floats(0.5, 2.0),
    spread=st.floats(0.5, 8.0),
    original=st.sampled_from([8, 512, 8192]),
)
def test_llama3_scaling_is_transformers_bit_for_bit(head_dim, theta, factor, low, spread, original):
    parameters = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": low + spread,
        "original_max_position_embeddings": original,
    }
    ours = inverse_frequencies(
        head_dim, theta, scaling=RopeScaling("llama3", factor, low, low + spread, original)
    )
    assert torch.equal(ours, _transformers_inv_freq(head_dim, theta, parameters))


@pytest.mark.parametrize("factor", [0.5, 2.0, 8.0])
def test_linear_scaling_is_transformers_bit_for_bit(factor):
    ours = inverse_frequencies(64, 10_000.0, scaling=RopeScaling("linear", factor))
    theirs = _transformers_inv_freq(64, 10_000.0, {"rope_type": "linear", "factor": factor})
    assert torch.equal(ours, theirs)


def test_unscaled_tables_are_unchanged_by_the_scaling_argument():
    plain = rope_tables(32, 16, 10_000.0, torch.float32, "cpu")
    also = rope_tables(32, 16, 10_000.0, torch.float32, "cpu", scaling=None)
    assert all(torch.equal(a, b) for a, b in zip(plain, also, strict=True))
    stretched = rope_tables(
        32, 16, 10_000.0, torch.float32, "cpu", scaling=RopeScaling("linear", 2)
    )
    # Linear scaling by 2 puts position 2p where plain RoPE puts p.
    assert torch.allclose(stretched[0][2 * 7], plain[0][7], atol=1e-6)


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "yarn", "factor": 2.0},
        {"kind": "linear", "factor": 0.0},
        {"kind": "linear", "factor": float("nan")},
        {"kind": "llama3", "factor": 8.0},  # no original context
        {
            "kind": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 4.0,
            "high_freq_factor": 1.0,
        },
    ],
)
def test_scalings_that_mean_nothing_are_refused(fields):
    with pytest.raises(ValueError):
        RopeScaling(**fields)
