"""GPT-J against transformers: parallel residual from one ln_1, partial rotary in the
interleaved ("rotate every two") convention, biased MLP and LM head, gelu_new."""

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

SMALL = {"hidden_size": 64, "num_layers": 3, "num_heads": 4}
VARIANTS = {
    # head_dim 16 of which 8 rotate: the partial rotary GPT-J-6B uses (64 of 256).
    "partial-rotary": {**SMALL, "config_overrides": {"rotary_dim": 8}},
    "full-rotary": {**SMALL, "num_layers": 2, "config_overrides": {"rotary_dim": 16}},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory) -> ParityPair:
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    create_checkpoint(directory, arch="gptj", seed=31, **VARIANTS[request.param])
    return parity_pair(directory, "GPTJForCausalLM", seed=32)


def test_prompt_logits_match(pair: ParityPair) -> None:
    max_prompt_logit_diff(pair)


def test_decode_steps_match(pair: ParityPair) -> None:
    check_decode_steps(pair)


def test_greedy_generation_matches(pair: ParityPair) -> None:
    check_greedy_generation(pair)


def test_checkpoint_saved_by_transformers_loads(pair: ParityPair, tmp_path: Path) -> None:
    check_transformers_save_loads(pair, tmp_path)


def test_rotary_tables_cover_only_the_rotary_dims(pair: ParityPair) -> None:
    assert pair.engine.model.rope_table.shape[-1] == 2 * pair.engine.spec.rotary_dim
