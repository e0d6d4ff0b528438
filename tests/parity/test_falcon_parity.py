"""Falcon against transformers, in each decoder design the family has.

* "7b": Falcon-7B's design: multi-query attention (one KV head), attention and MLP in
  parallel from one input_layernorm, LM head tied to the embeddings.
* "40b": Falcon-40B's new_decoder_architecture: grouped KV heads, with the fused
  query_key_value laid out per KV group, and separate ln_attn / ln_mlp.
* "40b-one-norm": the new architecture with num_ln_in_parallel_attn 1.
* "sequential-bias": the original multi-head design without parallel_attn, with biases
  on every linear layer.
* "40b-rope-linear": the new architecture with linear RoPE scaling (factor 4), written
  the transformers 4 way (``rope_scaling``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from monitor_agent.engine.rope import inverse_frequencies  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402
from tests.parity.harness import (  # noqa: E402
    ParityPair,
    check_decode_steps,
    check_greedy_generation,
    check_transformers_save_loads,
    max_prompt_logit_diff,
    parity_pair,
)

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 8}
VARIANTS = {
    "7b": {**SMALL, "num_kv_heads": 1, "tie_word_embeddings": True},
    "40b": {**SMALL, "num_kv_heads": 2},
    "40b-one-norm": {
        **SMALL,
        "num_kv_heads": 4,
        "config_overrides": {"num_ln_in_parallel_attn": 1},
    },
    "sequential-bias": {
        **SMALL,
        "num_heads": 4,
        "config_overrides": {"parallel_attn": False, "bias": True},
    },
    "40b-rope-linear": {
        **SMALL,
        "num_kv_heads": 2,
        "config_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    },
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory) -> ParityPair:
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    create_checkpoint(directory, arch="falcon", seed=21, **VARIANTS[request.param])
    return parity_pair(directory, "FalconForCausalLM", seed=22)


def test_prompt_logits_match(pair: ParityPair) -> None:
    max_prompt_logit_diff(pair)


def test_decode_steps_match(pair: ParityPair) -> None:
    check_decode_steps(pair)


def test_greedy_generation_matches(pair: ParityPair) -> None:
    check_greedy_generation(pair)


def test_checkpoint_saved_by_transformers_loads(pair: ParityPair, tmp_path: Path) -> None:
    check_transformers_save_loads(pair, tmp_path)


def test_kv_cache_holds_only_the_kv_heads(pair: ParityPair) -> None:
    """Multi-query and grouped attention cache num_kv_heads heads, not num_heads."""
    cache = pair.engine.model.layers[0].self_attn.kv_cache
    assert cache is not None
    assert cache.keys.shape[1] == pair.engine.spec.num_kv_heads


def test_a_scaled_rope_is_applied_by_both(tmp_path: Path) -> None:
    """Where the config scales RoPE, both sides read it: transformers' rotary frequencies
    are the engine's, and not the unscaled ones (so the "40b-rope-linear" logits compared
    above differ from plain RoPE's)."""
    directory = tmp_path / "ckpt"
    create_checkpoint(directory, arch="falcon", seed=21, **VARIANTS["40b-rope-linear"])
    pair = parity_pair(directory, "FalconForCausalLM", seed=22)
    spec = pair.engine.spec
    assert spec.rope_scaling is not None and spec.rope_scaling.kind == "linear"
    ours = inverse_frequencies(spec.rotary_dim, spec.rope_theta, scaling=spec.rope_scaling)
    assert torch.equal(pair.hf.transformer.rotary_emb.inv_freq.float(), ours)
    assert not torch.equal(ours, inverse_frequencies(spec.rotary_dim, spec.rope_theta))
