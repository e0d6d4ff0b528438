"""iserve reads the weight files transformers' ``from_pretrained`` loads, whatever lies
beside them.

``save_pretrained`` into a directory that already holds a checkpoint removes the old
``model-0000i-of-0000n`` shards it does not overwrite, but neither a previous
``model.safetensors`` nor a previous ``model.safetensors.index.json``. transformers then
loads one set (``config.json``'s ``transformers_weights``, else ``model.safetensors``,
else the index's shards) and ignores the rest; each case here checks that iserve reads
the same tensors, against transformers itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fingerprint_svc.fingerprints import cut_fingerprint
from monitor_agent.engine.engine import Engine, SamplingConfig
from services.models.checkpoint import (
    InvalidCheckpoint,
    create_checkpoint,
    read_config,
    read_safetensors_index,
    validate_checkpoint,
    weight_files,
)

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
SHARD_BYTES = 40_000
PROMPT = [0, 17, 42, 99, 7]


def hf_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def assert_iserve_reads_what_transformers_loads(directory: Path) -> None:
    """Every tensor iserve reads, from the file it reads it from, equals the parameter
    transformers loaded."""
    loaded = hf_model(directory).state_dict()
    tensors = read_safetensors_index(directory)
    files = {file: load_file(str(directory / file)) for file in {i.file for i in tensors.values()}}
    for name, info in tensors.items():
        np.testing.assert_array_equal(files[info.file][name], loaded[name].numpy(), err_msg=name)


def edit_json(path: Path, **changes) -> None:
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


def test_a_resave_without_shards_leaves_an_index_transformers_ignores(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL, max_shard_bytes=SHARD_BYTES)
    hf_model(directory).save_pretrained(directory)
    # The old shards are gone, their index is not: it names missing files.
    assert (directory / "model.safetensors.index.json").is_file()
    assert not list(directory.glob("model-*.safetensors"))

    assert weight_files(directory) == [directory / "model.safetensors"]
    validate_checkpoint(directory)
    assert_iserve_reads_what_transformers_loads(directory)


def test_a_resave_in_shards_leaves_a_model_safetensors_transformers_loads(
    tmp_path: Path,
) -> None:
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL)
    original = hf_model(directory)
    tuned = hf_model(directory)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in tuned.parameters():
            param.add_(torch.randn(param.shape, generator=generator))
    tuned.save_pretrained(directory, max_shard_size="20KB")
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1 and (directory / "model.safetensors").is_file()

    # transformers prefers model.safetensors: the weights saved before, not the shards.
    assert {info.file for info in validate_checkpoint(directory).tensors.values()} == {
        "model.safetensors"
    }
    assert weight_files(directory) == [directory / "model.safetensors"]
    assert_iserve_reads_what_transformers_loads(directory)
    # The engine serves those weights too: greedy tokens as transformers generates them.
    with torch.inference_mode():
        expected = original.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)
    engine = Engine(directory, max_seq_len=64)
    served = [step.token_id for step in engine.generate(PROMPT, 6, SamplingConfig())]
    assert served == expected[0, len(PROMPT) :].tolist()


def test_a_stray_file_beside_model_safetensors_is_not_read(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL)
    other = create_checkpoint(tmp_path / "other", **SMALL, seed=1)
    # A tensor in a file transformers does not open is not "in two files".
    shutil.copyfile(other / "model.safetensors", directory / "extra.safetensors")
    (directory / "model.safetensors.index.json").write_text("not json")
    validate_checkpoint(directory)
    assert_iserve_reads_what_transformers_loads(directory)


def test_the_dtype_is_the_loaded_files_not_the_first_by_name(tmp_path: Path) -> None:
    # model-00001-… sorts before model.safetensors; transformers reads the latter.
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL, dtype="float32")
    sharded = create_checkpoint(
        tmp_path / "sharded", **SMALL, dtype="bfloat16", max_shard_bytes=SHARD_BYTES
    )
    for path in [*sharded.glob("model-*.safetensors"), sharded / "model.safetensors.index.json"]:
        shutil.copyfile(path, directory / path.name)
    for config in (directory / "config.json", sharded / "config.json"):
        value = json.loads(config.read_text())
        value.pop("dtype", None)
        value.pop("torch_dtype", None)
        config.write_text(json.dumps(value))
    assert read_config(directory)["dtype"] == "float32"
    assert hf_model(directory).dtype == torch.float32
    # Where the index's metadata names a dtype, transformers takes that one.
    edit_json(
        sharded / "model.safetensors.index.json",
        metadata={"total_size": 0, "dtype": "float16"},
    )
    assert read_config(sharded)["dtype"] == "float16"
    assert hf_model(sharded).dtype == torch.float16


def test_a_config_naming_its_weights_file_is_read_from_it(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL)
    other = create_checkpoint(tmp_path / "other", **SMALL, seed=1)
    shutil.copyfile(other / "model.safetensors", directory / "tuned.safetensors")
    edit_json(directory / "config.json", transformers_weights="tuned.safetensors")
    assert weight_files(directory) == [directory / "tuned.safetensors"]
    assert_iserve_reads_what_transformers_loads(directory)
    # A fingerprint, cut from the weights named, holds its own model.safetensors.
    assert "transformers_weights" not in read_config(directory)
    cut_fingerprint(directory, tmp_path / "fingerprint", 1)
    validate_checkpoint(tmp_path / "fingerprint")


@pytest.mark.parametrize(
    ("named", "message"),
    [
        ("pytorch_model.bin", "must name a \\*.safetensors file"),
        (7, "must name a \\*.safetensors file"),
        ("../model.safetensors", "is outside the checkpoint directory"),
        ("tuned.safetensors", "names 'tuned.safetensors', which is missing"),
    ],
)
def test_a_config_naming_weights_iserve_cannot_read_is_refused(
    tmp_path: Path, named: object, message: str
) -> None:
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL)
    edit_json(directory / "config.json", transformers_weights=named)
    with pytest.raises(InvalidCheckpoint, match=message):
        validate_checkpoint(directory)


def test_broken_chosen_sets_are_still_refused(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL, max_shard_bytes=SHARD_BYTES)
    index = directory / "model.safetensors.index.json"
    text = index.read_text()
    index.write_text("not json")
    with pytest.raises(InvalidCheckpoint, match="index.json is not valid JSON"):
        validate_checkpoint(directory)
    for broken in ({"weight_map": {}}, {"metadata": {}, "weight_map": {}}, {"metadata": {}}):
        index.write_text(json.dumps(broken))
        with pytest.raises(InvalidCheckpoint, match='index.json is malformed: it needs a "meta'):
            validate_checkpoint(directory)
    index.write_text(text)
    last = sorted(directory.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(InvalidCheckpoint, match=f"missing: \\['{last.name}'\\]"):
        validate_checkpoint(directory)
