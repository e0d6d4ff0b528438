"""Checkpoints written by transformers itself (tests/parity/transformers_checkpoints.py),
served from their text: registration accepts each; the engine encodes the prompt exactly
as transformers' AutoTokenizer does; greedy generation equals transformers' generate,
token for token, unsharded (1, 1), tensor-parallel (2, 1) and on an uneven pipeline
(1, 2) of 1 + 2 layers. The parallel layouts run their ranks as real processes
(``python -m tests.unit.parallel_harness --scenario text``), every family in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fingerprint_svc.registry import build_model  # noqa: E402
from monitor_agent.engine.engine import Engine  # noqa: E402
from services.api import model_service_pb2 as model_pb  # noqa: E402
from services.models.checkpoint import validate_checkpoint  # noqa: E402
from tests.parity.transformers_checkpoints import (  # noqa: E402
    CONFIG_EDITS,
    FAMILIES,
    VOCAB_SIZE,
    write_checkpoint,
)
from tests.unit.parallel_harness import (  # noqa: E402
    MAX_SEQ_LEN,
    TEXT_PROMPT,
    TEXT_TOKENS,
    launch,
    text_scenario,
    wait_all,
)

# name: (tp, pp, (first_layer, layer_count) of each stage)
LAYOUTS = {"tp2": (2, 1, ((0, 3),)), "pp2-uneven-1+2": (1, 2, ((0, 1), (1, 2)))}
RUN_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved-by-transformers")
    return {
        name: write_checkpoint(root / name, name, seed=index)
        for index, name in enumerate(sorted(FAMILIES))
    }


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, dict[str, list[int]]]:
    """Per family: transformers' prompt ids and greedy tokens (stopping at EOS)."""
    out = {}
    for name, directory in checkpoints.items():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
        ids = tokenizer(TEXT_PROMPT)["input_ids"]
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32
        ).eval()
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=TEXT_TOKENS, do_sample=False
            )
        out[name] = {"ids": ids, "tokens": generated[0, len(ids) :].tolist()}
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_registration_accepts_the_checkpoint(checkpoints, family, caplog):
    directory = checkpoints[family]
    request = model_pb.RegisterModelRequest(model_id=family, checkpoint_path=directory.name)
    model = build_model(request, directory.parent)  # what RegisterModel validates and stores
    assert model.shape.num_layers == 3 and model.shape.vocab_size == VOCAB_SIZE
    if family in CONFIG_EDITS:  # tied by the config over a head of other values
        assert not model.shape.tie_word_embeddings
        assert "serving the checkpoint's own head" in caplog.text
    if family == "gptj":  # HF's GPT-J config keeps 50256 whatever the vocabulary
        spec = validate_checkpoint(directory).spec
        assert spec.bos_token_id is None and spec.eos_token_ids == ()
        assert "outside the vocabulary" in caplog.text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_and_greedy_tokens_match_transformers_unsharded(checkpoints, expected, family):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = text_scenario(Engine(checkpoints[family], max_seq_len=MAX_SEQ_LEN))
    finally:
        torch.set_num_threads(previous)
    assert got["ids"] == expected[family]["ids"]
    assert got["tokens"] == expected[family]["tokens"]


def test_text_and_greedy_tokens_match_transformers_in_parallel(checkpoints, expected, tmp_path):
    names = sorted(checkpoints)
    paths = [checkpoints[name] for name in names]
    runs = {
        layout: (
            launch(layout, tp, pp, layers, paths, tmp_path / layout, "cpu", "--scenario", "text"),
            tmp_path / layout,
        )
        for layout, (tp, pp, layers) in LAYOUTS.items()
    }
    wait_all(runs, RUN_TIMEOUT_S)
    for layout, (_, out) in runs.items():
        for index, name in enumerate(names):
            got = json.loads((out / f"{index}.json").read_text())
            assert got == expected[name], f"{name} at {layout}"


def test_the_bos_comes_only_from_the_tokenizer_file(expected):
    # llama's tokenizer.json adds <s>; the others add nothing (no tokenizer_config.json).
    assert expected["llama"]["ids"][0] == 0
    assert all(expected[name]["ids"][0] != 0 for name in expected if name != "llama")


@pytest.mark.parametrize("family", sorted(CONFIG_EDITS))
def test_transformers_keeps_the_head_a_config_ties_over(checkpoints, family):
    # What the greedy tokens above hold iserve to: the checkpoint's own LM head, untied.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoints[family]))
    assert model.config.tie_word_embeddings
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != embedding.data_ptr() and not torch.equal(head, embedding)
