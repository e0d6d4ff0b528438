"""Qwen2 against transformers: the Llama layout plus biases on q, k and v (not o)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from services.models.checkpoint import create_checkpoint  # noqa: E402
from tests.parity.harness import (  # noqa: E402
    ParityPair,
    check_decode_steps,
    check_greedy_generation,
    check_transformers_save_loads,
    max_prompt_logit_diff,
    parity_pair,
)

VARIANTS = {
    "gqa": {"hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2},
    "mqa-tied": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 1,
        "tie_word_embeddings": True,
    },
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory) -> ParityPair:
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    create_checkpoint(directory, arch="qwen2", seed=11, **VARIANTS[request.param])
    return parity_pair(directory, "Qwen2ForCausalLM", seed=12)


def test_prompt_logits_match(pair: ParityPair) -> None:
    max_prompt_logit_diff(pair)


def test_decode_steps_match(pair: ParityPair) -> None:
    check_decode_steps(pair)


def test_greedy_generation_matches(pair: ParityPair) -> None:
    check_greedy_generation(pair)


def test_only_query_key_value_have_biases(pair: ParityPair) -> None:
    attention = pair.engine.model.layers[0].self_attn
    assert all(p.bias is not None for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert attention.o_proj.bias is None
    assert pair.engine.model.layers[0].mlp.down_proj.bias is None


def test_checkpoint_saved_by_transformers_loads(pair: ParityPair, tmp_path: Path) -> None:
    check_transformers_save_loads(pair, tmp_path)
