"""The fingerprint cutter and its content-addressed cache."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from fingerprint_svc import fingerprints
from fingerprint_svc.fingerprints import (
    FINGERPRINTS_DIR,
    FingerprintCache,
    content_hash,
    cut_fingerprint,
)
from services.models.checkpoint import (
    create_checkpoint,
    read_config,
    read_safetensors_index,
    validate_checkpoint,
)
from services.models.families import parse_config

SHAPE = {"hidden_size": 64, "num_layers": 6, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A models root with a sharded bfloat16 Llama and a Falcon (fused QKV, one KV head)."""
    root = tmp_path_factory.mktemp("models")
    create_checkpoint(root / "llama", **SHAPE, dtype="bfloat16", max_shard_bytes=150_000)
    create_checkpoint(root / "falcon", arch="falcon", **{**SHAPE, "num_kv_heads": 1})
    return root


def _raw_tensor_bytes(directory, name: str) -> bytes:
    info = read_safetensors_index(directory)[name]
    path = directory / info.file
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header_len + info.data_offsets[0])
        return f.read(info.data_offsets[1] - info.data_offsets[0])


def test_cut_reads_only_the_tensors_it_keeps(root, tmp_path, monkeypatch):
    reads = []
    real_read_range = fingerprints.read_range

    def spy(path, start, stop):
        reads.append((path.name, start, stop))
        return real_read_range(path, start, stop)

    monkeypatch.setattr(fingerprints, "read_range", spy)
    source = root / "llama"
    cut_fingerprint(source, tmp_path / "fp", 2)

    kept = parse_config(read_config(tmp_path / "fp")).expected_tensors()
    index = read_safetensors_index(source)
    expected = set()
    for name in kept:
        info = index[name]
        with (source / info.file).open("rb") as f:
            data_start = 8 + struct.unpack("<Q", f.read(8))[0]
        expected.add(
            (info.file, data_start + info.data_offsets[0], data_start + info.data_offsets[1])
        )
    assert set(reads) == expected and len(reads) == len(expected)
    assert not any(name.startswith("model.layers.2.") for name in kept)
    assert len(index) > len(kept)  # the model's other layers were there and never read


@pytest.mark.parametrize("model", ["llama", "falcon"])
def test_fingerprint_is_the_first_layers_byte_for_byte(root, tmp_path, model):
    source = root / model
    written = cut_fingerprint(source, tmp_path / "fp", 2)

    checked = validate_checkpoint(tmp_path / "fp")
    assert checked.spec.num_layers == 2 and checked.weight_bytes == written
    original, cut = read_config(source), read_config(tmp_path / "fp")
    changed = {key: value for key, value in cut.items() if original.get(key) != value}
    assert changed and set(changed.values()) == {2} and set(cut) == set(original)
    assert all("layer" in key for key in changed)
    for name in checked.spec.expected_tensors():
        assert _raw_tensor_bytes(tmp_path / "fp", name) == _raw_tensor_bytes(source, name), name
    for file_name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "fp" / file_name).read_bytes() == (source / file_name).read_bytes()


def test_cut_needs_fewer_layers_than_the_model(root, tmp_path):
    for layers in (0, 6, 7):
        with pytest.raises(ValueError, match="fingerprint needs 1 to 5 layers"):
            cut_fingerprint(root / "llama", tmp_path / f"fp{layers}", layers)


def test_fingerprint_logits_equal_the_truncated_model(root):
    torch = pytest.importorskip("torch")
    from monitor_agent.engine.engine import Engine

    cache = FingerprintCache(root)
    fingerprint = cache.fingerprint("falcon", 2)
    cut = Engine(root / fingerprint.checkpoint_path, max_seq_len=16)
    full = Engine(root / "falcon", max_seq_len=16)
    full.model.layers = full.model.layers[:2]  # the model's first two layers, then its head
    ids = torch.tensor([[5, 17, 42, 7, 99]])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        expected = full.model(ids, positions, torch.tensor([0]))
        got = cut.model(ids, positions, torch.tensor([0]))
    assert torch.equal(got, expected)


def test_cache_cuts_once_per_content(root, tmp_path, monkeypatch):
    models = tmp_path / "models"
    shutil.copytree(root / "llama", models / "a")
    shutil.copytree(root / "llama", models / "copy-of-a")
    cache = FingerprintCache(models)
    first = cache.fingerprint("a", 1)
    assert first.checkpoint_path == f"{FINGERPRINTS_DIR}/{content_hash(models / 'a')}/L1"
    manifest = json.loads((models / first.checkpoint_path / "fingerprint.json").read_text())
    assert manifest["source"] == "a" and manifest["num_layers"] == 1

    def no_cutting(*args):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(fingerprints, "cut_fingerprint", no_cutting)
    assert cache.fingerprint("a", 1) == first
    assert cache.fingerprint("copy-of-a", 1) == first  # same content, another path
    assert not [p for p in (models / FINGERPRINTS_DIR).rglob(".L*")]  # no temporaries left


def test_content_hash_follows_config_weights_and_tokenizer(root, tmp_path):
    shutil.copytree(root / "llama", tmp_path / "m")
    base = content_hash(tmp_path / "m")
    assert content_hash(tmp_path / "m") == base

    config = read_config(tmp_path / "m")
    config["rope_theta"] = 5000.0
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert content_hash(tmp_path / "m") != base

    shutil.copytree(root / "llama", tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").write_text("{}")
    assert content_hash(tmp_path / "t") != base

    shutil.copytree(root / "llama", tmp_path / "w")
    last_shard = sorted((tmp_path / "w").glob("*.safetensors"))[-1]
    data = bytearray(last_shard.read_bytes())
    data[-1] ^= 0xFF  # the last MiB of a shard is hashed
    last_shard.write_bytes(bytes(data))
    assert content_hash(tmp_path / "w") != base

    # A file transformers does not load (a leftover of an earlier save) is not the model.
    shutil.copytree(root / "llama", tmp_path / "x")
    (tmp_path / "x" / "model-old.safetensors").write_bytes(last_shard.read_bytes())
    assert content_hash(tmp_path / "x") == base


def test_full_layer_count_is_the_model_itself(root):
    cache = FingerprintCache(root)
    full = cache.fingerprint("llama", 6)
    assert full.full_model and full.checkpoint_path == "llama" and full.num_layers == 6
    assert full.weight_bytes == validate_checkpoint(root / "llama").weight_bytes


def test_release_removes_a_content_once_no_model_profiles_on_it(root, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(root / "llama", models / "a")
    shutil.copytree(root / "llama", models / "copy-of-a")
    shutil.copytree(root / "falcon", models / "b")
    cache = FingerprintCache(models)
    shared = cache.fingerprint("a", 1, "model-a")
    assert cache.fingerprint("copy-of-a", 2, "model-copy").checkpoint_path.startswith(
        shared.checkpoint_path.rsplit("/", 1)[0]
    )
    other = cache.fingerprint("b", 1, "model-b")
    content = models / shared.checkpoint_path / ".."

    # model-copy still profiles on the shared content: nothing goes.
    assert cache.release("model-a", ["a"], ["copy-of-a", "b"]) == 0
    assert (models / shared.checkpoint_path / "model.safetensors").is_file()
    assert cache.release("model-unknown") == 0

    size = sum(f.stat().st_size for f in content.resolve().rglob("*") if f.is_file())
    # Everything but the released model's own record, removed first.
    assert cache.release("model-copy", ["copy-of-a"], ["b"]) == size - len("model-copy\n") > 0
    assert not content.resolve().exists()
    assert (models / other.checkpoint_path / "model.safetensors").is_file()  # another content
    assert (models / "a" / "config.json").is_file()  # checkpoints are never touched

    # Used again after a release: cut again.
    again = cache.fingerprint("a", 1, "model-a2")
    assert again == shared and (models / again.checkpoint_path / "model.safetensors").is_file()


def test_release_of_fingerprints_cut_before_users_were_recorded(root, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(root / "llama", models / "a")
    cache = FingerprintCache(models)
    legacy = cache.fingerprint("a", 1)  # no user: as cut by an earlier version
    content = (models / legacy.checkpoint_path).parent
    assert not (content / "users").exists()

    assert cache.release("model-x", ["elsewhere"]) == 0  # not cut from its checkpoint
    assert cache.release("model-a", ["a"], kept=["a"]) == 0  # another model still has it
    assert content.is_dir()
    assert cache.release("model-a", ["./a/"]) > 0
    assert not content.exists()


def test_release_leaves_what_it_cannot_remove_and_goes_on(root, tmp_path, monkeypatch, caplog):
    models = tmp_path / "models"
    shutil.copytree(root / "llama", models / "a")
    shutil.copytree(root / "falcon", models / "b")
    cache = FingerprintCache(models)
    a = cache.fingerprint("a", 1, "m")
    b = cache.fingerprint("b", 1, "m")
    real_rmtree = shutil.rmtree
    stuck = (models / a.checkpoint_path).parent

    def rmtree(path, *args, **kwargs):
        if Path(path) == stuck:
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(fingerprints.shutil, "rmtree", rmtree)
    assert cache.release("m") > 0
    assert stuck.is_dir() and not (models / b.checkpoint_path).exists()
    assert "not removed" in caplog.text and "Permission denied" in caplog.text


@pytest.mark.parametrize("when", ["as the cut starts", "while cutting", "after the rename"])
def test_a_model_released_while_its_fingerprint_is_cut_leaves_nothing(
    root, tmp_path, monkeypatch, when
):
    models = tmp_path / "models"
    shutil.copytree(root / "llama", models / "a")
    cache = FingerprintCache(models)
    real_cut, real_rename = fingerprints.cut_fingerprint, os.rename

    def cut_then_deleted(*args):
        if when == "as the cut starts":  # the cut then makes the directories again
            cache.release("model-a", ["a"])
        written = real_cut(*args)
        if when == "while cutting":
            cache.release("model-a", ["a"])
        return written

    def rename_then_deleted(*args):
        real_rename(*args)
        cache.release("model-a", ["a"])

    if when == "after the rename":
        monkeypatch.setattr(fingerprints.os, "rename", rename_then_deleted)
    else:
        monkeypatch.setattr(fingerprints, "cut_fingerprint", cut_then_deleted)
    with pytest.raises(FileNotFoundError):
        cache.fingerprint("a", 1, "model-a")
    assert list((models / FINGERPRINTS_DIR).iterdir()) == [models / FINGERPRINTS_DIR / ".lock"]


def test_a_release_where_the_lock_cannot_be_made_removes_nothing_and_says_so(
    root, tmp_path, monkeypatch, caplog
):
    """A read-only models root: the model's delete must still succeed (the release was
    outside the lock's try and failed the delete after the record was gone)."""
    models = tmp_path / "models"
    shutil.copytree(root / "llama", models / "a")
    cache = FingerprintCache(models)
    kept = cache.fingerprint("a", 1, "m")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(models / FINGERPRINTS_DIR / ".lock"))

    monkeypatch.setattr(fingerprints.os, "open", refused)
    assert cache.release("m", ["a"]) == 0
    assert "not removed" in caplog.text and "Permission denied" in caplog.text
    monkeypatch.undo()
    assert (models / kept.checkpoint_path / "model.safetensors").is_file()
