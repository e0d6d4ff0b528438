"""Special-token ids outside the vocabulary are dropped with a warning, and a checkpoint
that has them registers and serves."""

from __future__ import annotations

import json
import logging

import pytest

from monitor_agent.engine.engine import Engine, SamplingConfig
from services.models.checkpoint import InvalidCheckpoint, create_checkpoint, validate_checkpoint
from services.models.special_tokens import generation_eos_ids

PROMPT = "The river runs past the old mill, and under the stone bridge."
EOS_ID = 1
VOCAB_SIZE = 300


def test_gptj_with_special_ids_outside_the_vocabulary_registers_and_serves(
    tmp_path, caplog
) -> None:
    """Like Hugging Face's GPT-J config on a small vocabulary: BOS and EOS 50256."""
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        directory = create_checkpoint(
            tmp_path / "gptj",
            arch="gptj",
            seed=2,
            hidden_size=64,
            num_layers=1,
            num_heads=4,
            config_overrides={"bos_token_id": 50256, "eos_token_id": 50256},
        )
        spec = validate_checkpoint(directory).spec
    assert (spec.bos_token_id, spec.eos_token_ids) == (None, ())
    assert "config bos_token_id 50256 is outside the vocabulary" in caplog.text
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 50256]}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        engine = Engine(directory, max_seq_len=64)
    assert engine.eos_token_ids == frozenset({1})
    assert "generation_config.json eos_token_id 50256 is outside the vocabulary" in caplog.text
    outputs = list(engine.generate(engine.encode(PROMPT), 4, SamplingConfig(ignore_eos=True)))
    assert len(outputs) == 4
    assert all(0 <= step.token_id < spec.vocab_size for step in outputs)


def test_generation_config_eos_ids(tmp_path) -> None:
    assert generation_eos_ids(tmp_path, VOCAB_SIZE) == frozenset()
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [EOS_ID, 7, 50256, True, "x"]}))
    assert generation_eos_ids(tmp_path, VOCAB_SIZE) == frozenset({EOS_ID, 7})
    path.write_text(json.dumps({"eos_token_id": 5}))
    assert generation_eos_ids(tmp_path, VOCAB_SIZE) == frozenset({5})
    path.write_text("[1, 2]")
    with pytest.raises(InvalidCheckpoint, match="generation_config.json is malformed"):
        generation_eos_ids(tmp_path, VOCAB_SIZE)
