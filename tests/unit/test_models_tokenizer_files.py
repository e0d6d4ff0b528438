"""Registration refuses tokenizer files the worker or the gateway would fail on later:
a tokenizer.json the tokenizers library cannot load, token ids beyond the model's
vocab_size, a chat template that does not compile."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fingerprint_svc.registry import build_model
from services.api import model_service_pb2 as model_pb
from services.errors import InvalidArgument
from services.models.checkpoint import (
    InvalidCheckpoint,
    build_tokenizer,
    create_checkpoint,
    validate_checkpoint,
)
from services.models.tokenizer import VOCAB_SIZE

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return create_checkpoint(tmp_path_factory.mktemp("ref") / "ckpt", **SMALL)


@pytest.fixture
def checkpoint(reference: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(reference, tmp_path / "ckpt"))


def register(directory: Path) -> model_pb.Model:
    request = model_pb.RegisterModelRequest(model_id="m", checkpoint_path=directory.name)
    return build_model(request, directory.parent)


def shrink_vocabulary(directory: Path, vocab_size: int) -> None:
    """Config and weights of a model whose vocabulary is ``vocab_size`` rows."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = np.ascontiguousarray(tensors[name][:vocab_size])
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))


def test_a_vocab_size_below_the_tokenizers_is_refused_naming_both(checkpoint: Path) -> None:
    shrink_vocabulary(checkpoint, 200)
    with pytest.raises(InvalidArgument, match=f"ids up to {VOCAB_SIZE - 1}.*vocab_size is 200"):
        register(checkpoint)


def test_an_added_token_beyond_the_vocab_size_is_accepted(checkpoint: Path) -> None:
    # A <pad> appended after a full vocabulary (some Llama-2 fine-tunes): transformers
    # loads it, and only a prompt holding that token lacks an embedding row.
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(["<|tool|>"])
    assert tokenizer.token_to_id("<|tool|>") == VOCAB_SIZE
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    assert validate_checkpoint(checkpoint).spec.vocab_size == VOCAB_SIZE


def test_a_vocab_size_padded_beyond_the_tokenizers_is_accepted(tmp_path: Path) -> None:
    padded = create_checkpoint(tmp_path / "padded", **SMALL, vocab_size=VOCAB_SIZE + 128)
    assert register(padded).shape.vocab_size == VOCAB_SIZE + 128


@pytest.mark.parametrize(
    "content",
    ['{"version": "1.0", "model": 42}', '{"version": "1.0"}', "[]"],
)
def test_a_tokenizer_json_the_library_cannot_load_is_refused(checkpoint: Path, content) -> None:
    (checkpoint / "tokenizer.json").write_text(content)
    with pytest.raises(InvalidArgument, match="tokenizer.json in .* is not a tokenizer"):
        register(checkpoint)


BROKEN = "{% for m in messages %}{{ m['content'] }{% endfor %}"


def test_a_chat_template_that_does_not_compile_is_refused(checkpoint: Path) -> None:
    (checkpoint / "chat_template.jinja").write_text(BROKEN)
    with pytest.raises(InvalidArgument, match=r"chat_template.jinja does not compile.*'\}'"):
        register(checkpoint)
    (checkpoint / "chat_template.jinja").unlink()
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config["chat_template"] = "ok\n" + BROKEN
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidCheckpoint, match=r"tokenizer_config.json does not compile.*line 2"):
        validate_checkpoint(checkpoint)


def test_templates_that_compile_or_are_absent_are_accepted(tmp_path: Path) -> None:
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    plain = create_checkpoint(tmp_path / "plain", **SMALL, chat_template=None)
    refusing = create_checkpoint(tmp_path / "refusing", **SMALL, chat_template=strict)
    assert register(plain) and register(refusing)


def test_the_loader_skips_the_tokenizer_checks(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").write_text("{}")
    assert validate_checkpoint(checkpoint, require_tokenizer=False).spec.num_layers == 2
