"""A config that ties the LM head over a checkpoint holding a head of other values is
served with the checkpoint's own head, as transformers 5 loads it: by validation, by the
registered shape and its memory reservation, and by the loader at every layout. (The
greedy tokens against transformers' own are in tests/parity/test_saved_by_transformers.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from fingerprint_svc.fingerprints import cut_fingerprint
from fingerprint_svc.registry import build_model
from monitor_agent.engine.loader import load_model
from monitor_agent.engine.tensor_parallel import TensorShard
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.models.checkpoint import (
    InvalidCheckpoint,
    create_checkpoint,
    served_spec,
    validate_checkpoint,
)
from services.reservation import embedding_rank_bytes

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
HEAD = "lm_head.weight"


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def rewrite_weights(directory: Path, edit) -> dict[str, np.ndarray]:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def tied_over_own_head(directory: Path, arch: str = "llama") -> Path:
    """A checkpoint saved untied (a head of its own random values), then its config
    edited to say tied: Falcon's by dropping the field, which its config class defaults
    to true."""
    create_checkpoint(directory, arch=arch, **SMALL, tie_word_embeddings=False)
    edit_config(directory, tie_word_embeddings=None if arch == "falcon" else True)
    return directory


@pytest.mark.parametrize("arch", ["llama", "falcon"])
def test_a_head_of_other_values_is_kept_untied(tmp_path: Path, arch: str, caplog) -> None:
    untied = validate_checkpoint(create_checkpoint(tmp_path / "untied", arch=arch, **SMALL))
    checked = validate_checkpoint(tied_over_own_head(tmp_path / "edited", arch))
    assert not checked.spec.tie_word_embeddings and HEAD in checked.tensors
    assert checked.spec == untied.spec
    assert checked.weight_bytes == untied.weight_bytes == checked.spec.weight_bytes(4)
    assert "serving the checkpoint's own head" in caplog.text


def test_a_head_duplicating_the_embedding_stays_tied(tmp_path: Path) -> None:
    directory = tied_over_own_head(tmp_path / "ckpt")
    # The same values stored in another dtype are the same values.
    half = {}

    def duplicate_in_float16(tensors: dict) -> None:
        half["embedding"] = tensors["model.embed_tokens.weight"].astype(np.float16)
        tensors["model.embed_tokens.weight"] = half["embedding"].astype(np.float32)
        tensors[HEAD] = half["embedding"]

    rewrite_weights(directory, duplicate_in_float16)
    checked = validate_checkpoint(directory)
    assert checked.spec.tie_word_embeddings and HEAD not in checked.tensors
    assert checked.weight_bytes == checked.spec.weight_bytes(4)


def test_the_comparison_reads_every_chunk(tmp_path: Path, monkeypatch) -> None:
    directory = tied_over_own_head(tmp_path / "ckpt")

    def differ_in_the_last_element(tensors: dict) -> None:
        tensors[HEAD] = tensors["model.embed_tokens.weight"].copy()
        tensors[HEAD][-1, -1] += 1.0

    rewrite_weights(directory, differ_in_the_last_element)
    monkeypatch.setattr("services.models.tied_head._CHUNK_ELEMENTS", 100)
    assert not validate_checkpoint(directory).spec.tie_word_embeddings


def test_a_head_of_another_shape_is_refused(tmp_path: Path) -> None:
    directory = tied_over_own_head(tmp_path / "ckpt")
    rewrite_weights(directory, lambda t: t.update({HEAD: np.zeros((10, 32), np.float32)}))
    with pytest.raises(InvalidCheckpoint, match=r"'lm_head.weight' has shape \[10, 32\]"):
        validate_checkpoint(directory)


def test_registration_records_and_reserves_the_untied_head(tmp_path: Path) -> None:
    request = model_pb.RegisterModelRequest(model_id="m", checkpoint_path="edited")
    tied_over_own_head(tmp_path / "edited")
    create_checkpoint(tmp_path / "untied", **SMALL)
    shape = build_model(request, tmp_path).shape
    untied = build_model(
        model_pb.RegisterModelRequest(model_id="u", checkpoint_path="untied"), tmp_path
    ).shape
    assert not shape.tie_word_embeddings
    assert (shape.parameter_count, shape.weight_bytes) == (
        untied.parameter_count,
        untied.weight_bytes,
    )
    whole = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1)
    vocab_by_hidden = shape.vocab_size * shape.hidden_size
    assert embedding_rank_bytes(shape, whole) == 2 * vocab_by_hidden * 4


@pytest.mark.parametrize("arch", ["llama", "falcon"])
def test_every_layout_loads_the_checkpoints_own_head(tmp_path: Path, arch: str) -> None:
    directory = tied_over_own_head(tmp_path / "ckpt", arch)
    tensors = load_file(str(directory / "model.safetensors"))
    head = torch.from_numpy(tensors[HEAD])
    embedding = validate_checkpoint(directory).spec.embedding_tensor
    assert not torch.equal(head, torch.from_numpy(tensors[embedding]))
    layouts = {
        "whole": load_model(directory),
        "last pipeline stage": load_model(directory, first_layer=1),
        **{
            f"tensor rank {rank}": load_model(directory, tensor_parallel=TensorShard(2, rank))
            for rank in range(2)
        },
    }
    for layout, model in layouts.items():
        assert torch.equal(model.lm_head.weight, head), layout


@pytest.mark.parametrize("arch", ["llama", "falcon"])
def test_a_fingerprint_keeps_the_checkpoints_own_head(tmp_path: Path, arch: str) -> None:
    source = tied_over_own_head(tmp_path / "edited", arch)
    cut_fingerprint(source, tmp_path / "cut", 1)
    cut = validate_checkpoint(tmp_path / "cut", require_tokenizer=False)
    assert not cut.spec.tie_word_embeddings and HEAD in cut.tensors
    assert np.array_equal(
        load_file(str(tmp_path / "cut" / "model.safetensors"))[HEAD],
        load_file(str(source / "model.safetensors"))[HEAD],
    )
    # The profiler reserves for the head it will load.
    assert not served_spec(source).tie_word_embeddings
