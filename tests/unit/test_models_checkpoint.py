"""Reading, validating and creating checkpoint directories; the test tokenizer."""

from __future__ import annotations

import errno
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from services.models.checkpoint import (
    InvalidCheckpoint,
    InvalidConfig,
    TensorInfo,
    UnsupportedArchitecture,
    build_tokenizer,
    create_checkpoint,
    read_config,
    read_safetensors_index,
    served_spec,
    validate_checkpoint,
)
from services.models.safetensors_format import float32_to_bfloat16_bits
from services.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
TOKENIZER = build_tokenizer()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """A valid checkpoint; tests copy it before breaking it."""
    return create_checkpoint(tmp_path_factory.mktemp("ref") / "ckpt", **SMALL)


@pytest.fixture
def checkpoint(reference: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(reference, tmp_path / "ckpt"))


def rewrite_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# --- creating and validating -------------------------------------------------------------


def test_created_checkpoint_validates(reference: Path) -> None:
    checked = validate_checkpoint(reference)
    spec = checked.spec
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (32, 2, 4, 2)
    assert spec.vocab_size == TOKENIZER.get_vocab_size()
    assert spec.intermediate_size == 96  # 8/3 * 32 rounded up to a multiple of 32
    assert (spec.bos_token_id, spec.eos_token_ids) == (BOS_TOKEN_ID, (EOS_TOKEN_ID,))
    assert checked.has_tokenizer
    assert checked.weight_bytes == spec.weight_bytes(4)
    assert set(checked.tensors) == set(spec.expected_tensors())
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (reference / name).is_file()


def test_config_is_hf_llama_format(reference: Path) -> None:
    config = read_config(reference)
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == TOKENIZER.token_to_id("</s>")


def test_headers_agree_with_safetensors_library(reference: Path) -> None:
    index = read_safetensors_index(reference)
    with safe_open(str(reference / "model.safetensors"), framework="numpy") as f:
        assert set(f.keys()) == set(index)
        for name in index:
            assert tuple(f.get_slice(name).get_shape()) == index[name].shape
            assert index[name] == TensorInfo(
                "F32", index[name].shape, "model.safetensors", index[name].data_offsets
            )


def test_weights_are_deterministic_and_initialised(reference: Path, tmp_path: Path) -> None:
    again = create_checkpoint(tmp_path / "again", **SMALL)
    other_seed = create_checkpoint(tmp_path / "seed1", **SMALL, seed=1)
    original = (reference / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == original
    assert (other_seed / "model.safetensors").read_bytes() != original
    tensors = load_file(str(reference / "model.safetensors"))
    assert np.all(tensors["model.norm.weight"] == 1.0)
    assert abs(float(tensors["model.embed_tokens.weight"].std()) - 0.02) < 0.002


@pytest.mark.parametrize(
    ("dtype", "code", "size"), [("bfloat16", "BF16", 2), ("float16", "F16", 2)]
)
def test_half_precision_checkpoints(tmp_path: Path, dtype: str, code: str, size: int) -> None:
    directory = create_checkpoint(tmp_path / dtype, **SMALL, dtype=dtype)
    checked = validate_checkpoint(directory)
    assert checked.spec.torch_dtype == dtype
    assert {info.dtype for info in checked.tensors.values()} == {code}
    assert checked.weight_bytes == checked.spec.parameter_count() * size


def test_bfloat16_rounding_to_nearest_even() -> None:
    values = np.array([1.0, -2.5, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.0e38], dtype=np.float32)
    bits = float32_to_bfloat16_bits(values)
    # 1+2^-8 is halfway between bf16 neighbours 1 and 1+2^-7: ties go to the even one (1).
    assert bits.tolist() == [0x3F80, 0xC020, 0x3F80, 0x3F82, 0x7F62]


def test_sharded_checkpoint(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "sharded", **SMALL, max_shard_bytes=40_000)
    shards = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    checked = validate_checkpoint(directory)
    assert index["weight_map"] == {name: info.file for name, info in checked.tensors.items()}
    assert index["metadata"]["total_size"] == checked.weight_bytes
    (directory / shards[-1]).unlink()
    with pytest.raises(InvalidCheckpoint, match=f"missing: \\['{shards[-1]}'\\]"):
        validate_checkpoint(directory)


def test_progress_counts_every_weight_byte(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    directory = create_checkpoint(
        tmp_path / "p", **SMALL, max_shard_bytes=40_000, progress=lambda *x: seen.append(x)
    )
    total = validate_checkpoint(directory).weight_bytes
    assert seen[-1] == (total, total)
    assert all(a[0] < b[0] and a[1] == total for a, b in zip(seen, seen[1:], strict=False))


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path, monkeypatch) -> None:
    # A full-size preset is hundreds of GiB: a disk filled half-way would leave a broken
    # checkpoint and a full disk behind. The free space is the library's figure, shrunk.
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        "services.models.checkpoint.shutil.disk_usage",
        lambda path: real._replace(free=1 << 20),
    )
    with pytest.raises(OSError, match="needs 0.1 GiB and its disk has 0.0 GiB free") as full:
        create_checkpoint(tmp_path / "new" / "ckpt", **SMALL)
    assert full.value.errno == errno.ENOSPC
    assert not (tmp_path / "new").exists()


def test_a_pseudo_filesystem_or_a_read_only_directory_is_said_to_be_so(tmp_path, monkeypatch):
    """/proc said "its disk has 0.0 GiB free", which sent the user looking for space."""
    with pytest.raises(OSError, match="kernel pseudo-filesystem such as /proc") as refused:
        create_checkpoint(Path("/proc/iserve-ckpt"), **SMALL)
    assert refused.value.errno == errno.EROFS
    monkeypatch.setattr("services.models.checkpoint.os.access", lambda path, mode: False)
    with pytest.raises(OSError, match="is not writable by you") as refused:
        create_checkpoint(tmp_path / "new" / "ckpt", **SMALL)
    assert refused.value.errno == errno.EACCES and not (tmp_path / "new").exists()


def test_the_files_an_overwrite_replaces_count_as_free(checkpoint: Path, monkeypatch) -> None:
    stored = validate_checkpoint(checkpoint).weight_bytes
    real = shutil.disk_usage(checkpoint)
    monkeypatch.setattr(
        "services.models.checkpoint.shutil.disk_usage",
        lambda path: real._replace(free=(64 << 20) + 1),
    )
    # The same shape again fits in the space its old weights free...
    create_checkpoint(checkpoint, **SMALL, overwrite=True)
    assert validate_checkpoint(checkpoint).weight_bytes == stored
    # ...a larger one does not, and the old checkpoint stays whole.
    with pytest.raises(OSError, match="GiB free"):
        create_checkpoint(checkpoint, **{**SMALL, "hidden_size": 1024}, overwrite=True)
    assert validate_checkpoint(checkpoint).weight_bytes == stored


def test_tied_and_mistral_checkpoints(tmp_path: Path) -> None:
    tied = validate_checkpoint(
        create_checkpoint(tmp_path / "tied", **SMALL, tie_word_embeddings=True)
    )
    assert "lm_head.weight" not in tied.tensors
    mistral = create_checkpoint(tmp_path / "mistral", arch="mistral", sliding_window=16, **SMALL)
    assert validate_checkpoint(mistral).spec.sliding_window == 16


def test_create_refuses_non_empty_directory(reference: Path) -> None:
    with pytest.raises(FileExistsError, match="overwrite=True"):
        create_checkpoint(reference, **SMALL)


def test_create_overwrites_when_asked(checkpoint: Path) -> None:
    create_checkpoint(checkpoint, **{**SMALL, "num_layers": 1}, overwrite=True)
    assert validate_checkpoint(checkpoint).spec.num_layers == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_kv_heads": 3}, InvalidConfig, "num_key_value_heads"),
        ({"vocab_size": 10}, InvalidConfig, "smaller than the tokenizer"),
        ({"arch": "gpt2"}, UnsupportedArchitecture, "gpt2"),
        ({"sliding_window": 8}, InvalidConfig, "sliding_window"),
        ({"dtype": "int8"}, InvalidConfig, "int8"),
    ],
)
def test_create_rejects_bad_arguments(tmp_path: Path, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        create_checkpoint(tmp_path / "bad", **{**SMALL, **kwargs})


# --- what a user gets for a broken checkpoint ---------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidCheckpoint, match="does not exist"):
        validate_checkpoint(tmp_path / "nowhere")


def test_missing_config(checkpoint: Path) -> None:
    (checkpoint / "config.json").unlink()
    with pytest.raises(InvalidCheckpoint, match="config.json is missing"):
        validate_checkpoint(checkpoint)


def test_malformed_config_json(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(InvalidCheckpoint, match="not valid JSON"):
        read_config(checkpoint)


def test_config_not_an_object(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidCheckpoint, match="not a JSON object"):
        validate_checkpoint(checkpoint)


def test_unsupported_model_type(checkpoint: Path) -> None:
    edit_config(checkpoint, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture, match="gpt2"):
        validate_checkpoint(checkpoint)


def test_config_inconsistent_with_weights(checkpoint: Path) -> None:
    edit_config(checkpoint, num_hidden_layers=3)
    with pytest.raises(InvalidCheckpoint, match="model.layers.2.self_attn.q_proj.weight"):
        validate_checkpoint(checkpoint)


def test_missing_tensor(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        InvalidCheckpoint, match="missing tensor.*model.layers.1.mlp.up_proj.weight"
    ):
        validate_checkpoint(checkpoint)


def test_wrong_shape(checkpoint: Path) -> None:
    def shrink(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)

    rewrite_weights(checkpoint, shrink)
    with pytest.raises(
        InvalidCheckpoint, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[8, 32\]"
    ):
        validate_checkpoint(checkpoint)


def test_unexpected_tensor(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda t: t.update({"model.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(InvalidCheckpoint, match="unexpected tensor.*model.extra.weight"):
        validate_checkpoint(checkpoint)


def test_harmless_extra_tensors_are_accepted(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "tied", **SMALL, tie_word_embeddings=True)

    def add_extras(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4, np.float32)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    rewrite_weights(directory, add_extras)
    checked = validate_checkpoint(directory)
    assert "lm_head.weight" not in checked.tensors
    assert checked.weight_bytes == checked.spec.weight_bytes(4)


def test_integer_tensor_is_rejected(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda t: t.update({"model.norm.weight": np.ones(32, np.int32)}))
    with pytest.raises(InvalidCheckpoint, match="'model.norm.weight' has dtype I32"):
        validate_checkpoint(checkpoint)


def test_truncated_safetensors(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(InvalidCheckpoint, match="truncated"):
        validate_checkpoint(checkpoint)


def test_truncated_header(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(InvalidCheckpoint, match="header claims"):
        read_safetensors_index(checkpoint)


def test_file_too_short_for_a_header(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(InvalidCheckpoint, match="too short"):
        read_safetensors_index(checkpoint)


def test_corrupt_header_json(checkpoint: Path) -> None:
    garbage = b"{not json at all"
    (checkpoint / "model.safetensors").write_bytes(struct.pack("<Q", len(garbage)) + garbage)
    with pytest.raises(InvalidCheckpoint, match="not valid JSON"):
        read_safetensors_index(checkpoint)


def test_header_with_bad_offsets(checkpoint: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (checkpoint / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(16)
    )
    with pytest.raises(InvalidCheckpoint, match="'w': data_offsets"):
        read_safetensors_index(checkpoint)


def test_no_safetensors_files(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(
        InvalidCheckpoint, match=r"no \*.safetensors files in .* that transformers loads"
    ):
        validate_checkpoint(checkpoint)


def test_weights_under_another_name_are_not_read(checkpoint: Path) -> None:
    # transformers loads model.safetensors or the index's shards, no other file.
    (checkpoint / "model.safetensors").rename(checkpoint / "weights.safetensors")
    with pytest.raises(InvalidCheckpoint, match="not weights.safetensors unless config.json names"):
        validate_checkpoint(checkpoint)


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "sharded", **SMALL, max_shard_bytes=40_000)
    last = sorted(directory.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(last))
    tensors["model.embed_tokens.weight"] = np.zeros((4, 32), np.float32)
    save_file(tensors, str(last))
    with pytest.raises(InvalidCheckpoint, match="'model.embed_tokens.weight' appears in both"):
        read_safetensors_index(directory)


def test_missing_tokenizer(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(InvalidCheckpoint, match="tokenizer.json is missing"):
        validate_checkpoint(checkpoint)
    assert validate_checkpoint(checkpoint, require_tokenizer=False).has_tokenizer is False


def test_a_slow_tokenizer_alone_is_named_with_how_to_write_the_fast_one(checkpoint: Path) -> None:
    # GPT-2-style BPE files, as a slow tokenizer keeps them (the same vocabulary).
    TOKENIZER.model.save(str(checkpoint))
    (checkpoint / "tokenizer.json").unlink()
    # Naming the unk token: GPT2Tokenizer would add its default, <|endoftext|>, at id 640,
    # a row the 640-token model lacks (refused, see test_models_tokenizer_files.py).
    config = {"tokenizer_class": "GPT2Tokenizer", "unk_token": "</s>"}
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({**config, "bos_token": "<s>", "eos_token": "</s>"})
    )
    with pytest.raises(InvalidCheckpoint, match="slow tokenizer's vocab.json and merges.txt"):
        validate_checkpoint(checkpoint)
    # Doing what the message says makes the checkpoint whole.
    transformers = pytest.importorskip("transformers")
    transformers.AutoTokenizer.from_pretrained(checkpoint).save_pretrained(checkpoint)
    assert validate_checkpoint(checkpoint).has_tokenizer


# --- the tokenizer ------------------------------------------------------------------------


def test_tokenizer_is_small_and_deterministic() -> None:
    assert 512 <= TOKENIZER.get_vocab_size() <= 1024
    assert build_tokenizer().to_str() == TOKENIZER.to_str()
    assert (TOKENIZER.token_to_id("<s>"), TOKENIZER.token_to_id("</s>")) == (0, 1)


def test_tokenizer_prepends_bos_and_merges_common_words() -> None:
    encoding = TOKENIZER.encode("the model reads the prompt")
    assert encoding.ids[0] == BOS_TOKEN_ID
    assert len(encoding.ids) < len("the model reads the prompt") // 2


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_tokenizer_round_trips_any_text(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    assert TOKENIZER.decode(ids, skip_special_tokens=False) == text


def test_transformers_reads_the_tokenizer(reference: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(reference))
    text = "Hello wörld, the model reads 日本語!"
    assert hf_tokenizer(text)["input_ids"] == TOKENIZER.encode(text).ids
    assert hf_tokenizer.eos_token_id == EOS_TOKEN_ID


def test_package_does_not_import_torch() -> None:
    """The control plane uses services.models and must run without torch installed."""
    code = (
        "import sys, services.models.checkpoint, services.models.arch; "
        "sys.exit('torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_config_naming_no_dtype_takes_the_weights_dtype_as_transformers_does(
    tmp_path: Path, dtype: str
) -> None:
    # transformers' from_pretrained defaults to dtype="auto": the config's dtype, else
    # the first floating weight's. A checkpoint whose config names none is not float32.
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    directory = create_checkpoint(tmp_path / "ckpt", **SMALL, dtype=dtype)
    config = json.loads((directory / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps(config))

    assert read_config(directory)["dtype"] == dtype
    assert served_spec(directory).torch_dtype == dtype
    assert validate_checkpoint(directory).spec.torch_dtype == dtype
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert loaded.dtype == getattr(torch, dtype)
    # A config that names one keeps it, whatever the weights hold.
    config["torch_dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(config))
    assert served_spec(directory).torch_dtype == "float32"
