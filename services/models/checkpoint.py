"""Hugging Face checkpoint directories: read, validate and (for tests) create them.

A checkpoint directory holds ``config.json``, one or more ``*.safetensors`` files and a
``tokenizer.json``. Validation reads only the config and the safetensors headers, so it
is cheap enough to run when a model is registered and again before a worker loads it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.models.arch import HARMLESS_EXTRA_SUFFIXES, ArchSpec
from services.models.errors import InvalidCheckpoint, InvalidConfig, UnsupportedArchitecture
from services.models.safetensors_format import (
    CONFIG_TO_SAFETENSORS_DTYPE,
    TensorInfo,
    encode_tensor,
    read_safetensors_header,
    write_safetensors,
)
from services.models.tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer

__all__ = [
    "CONFIG_FILE",
    "TOKENIZER_FILE",
    "InvalidCheckpoint",
    "InvalidConfig",
    "TensorInfo",
    "UnsupportedArchitecture",
    "ValidatedCheckpoint",
    "build_tokenizer",
    "create_checkpoint",
    "read_config",
    "read_safetensors_index",
    "validate_checkpoint",
]

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
SHARD_INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F32", "F16", "BF16")
_INIT_STD = 0.02


@dataclass(frozen=True)
class ValidatedCheckpoint:
    """A checkpoint whose config and tensor headers agree; weight_bytes as stored on disk."""

    spec: ArchSpec
    tensors: dict[str, TensorInfo]
    weight_bytes: int
    has_tokenizer: bool


def read_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise InvalidCheckpoint(f"checkpoint directory {str(directory)!r} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise InvalidCheckpoint(f"{CONFIG_FILE} is missing from {str(directory)!r}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidCheckpoint(
            f"{CONFIG_FILE} in {str(directory)!r} is not valid JSON: {exc}"
        ) from exc
    if not isinstance(config, dict):
        raise InvalidCheckpoint(f"{CONFIG_FILE} in {str(directory)!r} is not a JSON object")
    return config


def read_safetensors_index(checkpoint_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor in the directory's ``*.safetensors`` files, from their headers only.

    Raises InvalidCheckpoint when there is no safetensors file, a header is corrupt or
    truncated, a tensor appears in two files, or a shard named by
    ``model.safetensors.index.json`` is missing.
    """
    directory = Path(checkpoint_dir)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InvalidCheckpoint(f"no *.safetensors files in {str(directory)!r}")
    _check_shard_index(directory, {f.name for f in files})
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name in tensors:
                raise InvalidCheckpoint(
                    f"tensor {name!r} appears in both {tensors[name].file} and {info.file}"
                )
            tensors[name] = info
    return tensors


def _check_shard_index(directory: Path, present: set[str]) -> None:
    index_path = directory / SHARD_INDEX_FILE
    if not index_path.is_file():
        return
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        wanted = set(weight_map.values())
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidCheckpoint(f"{SHARD_INDEX_FILE} is malformed: {exc}") from exc
    missing = sorted(wanted - present)
    if missing:
        raise InvalidCheckpoint(f"shards named in {SHARD_INDEX_FILE} are missing: {missing}")


def validate_checkpoint(
    checkpoint_dir: str | Path, *, require_tokenizer: bool = True
) -> ValidatedCheckpoint:
    """Check that a checkpoint can be served; every error names the field or tensor at fault.

    The config must describe a supported architecture; every tensor it implies must be
    present with exactly that shape in a float dtype; no other tensors may be present
    except harmless ones (rotary ``inv_freq`` buffers, an LM head duplicating tied
    embeddings); and ``tokenizer.json`` must exist unless ``require_tokenizer`` is False.
    """
    directory = Path(checkpoint_dir)
    spec = ArchSpec.from_hf_config(read_config(directory))
    tensors = read_safetensors_index(directory)
    expected = spec.expected_tensors()
    missing = [name for name in expected if name not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise InvalidCheckpoint(f"checkpoint is missing tensor(s): {shown}")
    for name, shape in expected.items():
        info = tensors[name]
        if info.shape != shape:
            raise InvalidCheckpoint(
                f"tensor {name!r} has shape {list(info.shape)} in {info.file}; "
                f"the config implies {list(shape)}"
            )
        if info.dtype not in _FLOAT_DTYPES:
            raise InvalidCheckpoint(
                f"tensor {name!r} has dtype {info.dtype}; expected one of {list(_FLOAT_DTYPES)}"
            )
    extra = [name for name in tensors if name not in expected and not _is_harmless(name, spec)]
    if extra:
        raise InvalidCheckpoint(
            f"checkpoint has unexpected tensor(s): {', '.join(sorted(extra)[:5])}"
        )
    has_tokenizer = (directory / TOKENIZER_FILE).is_file()
    if require_tokenizer and not has_tokenizer:
        raise InvalidCheckpoint(f"{TOKENIZER_FILE} is missing from {str(directory)!r}")
    return ValidatedCheckpoint(
        spec=spec,
        tensors={name: tensors[name] for name in expected},
        weight_bytes=sum(tensors[name].nbytes for name in expected),
        has_tokenizer=has_tokenizer,
    )


def _is_harmless(name: str, spec: ArchSpec) -> bool:
    # Some exporters store lm_head.weight even when it is tied to the embeddings.
    return name.endswith(HARMLESS_EXTRA_SUFFIXES) or (
        spec.tie_word_embeddings and name == "lm_head.weight"
    )


def create_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    sliding_window: int | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a randomly initialised Hugging Face checkpoint and return its directory.

    Matrices are N(0, 0.02²), norms are ones, biases zeros; the same arguments and seed
    always give the same bytes. ``vocab_size`` defaults to the tokenizer's; it may be
    larger (padding rows) but not smaller. ``arch`` is "llama" or "mistral" (the latter
    with an optional ``sliding_window``). With ``max_shard_bytes`` the weights are split
    into ``model-0000i-of-0000n.safetensors`` shards plus an index, as transformers does.
    Refuses to write into a non-empty directory unless ``overwrite`` is True.
    """
    directory = Path(out_dir)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{str(directory)!r} is not empty; pass overwrite=True to replace it")
    if arch not in ("llama", "mistral"):
        raise UnsupportedArchitecture(
            f"create_checkpoint writes 'llama' or 'mistral', not {arch!r}"
        )
    if sliding_window is not None and arch != "mistral":
        raise InvalidConfig("sliding_window is only meaningful for arch='mistral'")
    tokenizer = build_tokenizer()
    tokenizer_vocab = tokenizer.get_vocab_size()
    vocab_size = tokenizer_vocab if vocab_size is None else vocab_size
    if vocab_size < tokenizer_vocab:
        raise InvalidConfig(
            f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_vocab}"
        )
    if intermediate_size is None:
        # Llama's 8/3 expansion, rounded up to a multiple of 32.
        intermediate_size = 32 * math.ceil(8 * hidden_size / 3 / 32)
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    config: dict[str, Any] = {
        "architectures": ["MistralForCausalLM" if arch == "mistral" else "LlamaForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads if num_kv_heads is None else num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }
    if arch == "llama":
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
    else:
        config["sliding_window"] = sliding_window
    spec = ArchSpec.from_hf_config(config)  # rejects inconsistent sizes before writing

    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.safetensors"):
        stale.unlink()
    _write_random_weights(
        directory, spec, CONFIG_TO_SAFETENSORS_DTYPE[dtype], seed, max_shard_bytes
    )
    _write_json(directory / CONFIG_FILE, config)
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False},
    )
    tokenizer.save(str(directory / TOKENIZER_FILE))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_position_embeddings,
        },
    )
    return directory


def _write_random_weights(
    directory: Path, spec: ArchSpec, st_dtype: str, seed: int, max_shard_bytes: int | None
) -> None:
    shapes = spec.expected_tensors()
    shards = _split_into_shards(shapes, st_dtype, max_shard_bytes)
    rng = np.random.default_rng(seed)

    def tensor_bytes(name: str) -> bytes:
        shape = shapes[name]
        if name.endswith("norm.weight"):
            values = np.ones(shape, dtype=np.float32)
        elif name.endswith(".bias"):
            values = np.zeros(shape, dtype=np.float32)
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(_INIT_STD)
        return encode_tensor(values, st_dtype)

    if len(shards) == 1:
        names = {"model.safetensors": shards[0]}
    else:
        total = len(shards)
        names = {f"model-{i + 1:05d}-of-{total:05d}.safetensors": s for i, s in enumerate(shards)}
    total_bytes = 0
    for file_name, shard in names.items():
        layout = [(name, st_dtype, shapes[name]) for name in shard]
        total_bytes += write_safetensors(directory / file_name, layout, tensor_bytes)
    if len(names) > 1:
        weight_map = {name: file_name for file_name, shard in names.items() for name in shard}
        _write_json(
            directory / SHARD_INDEX_FILE,
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
        )


def _split_into_shards(
    shapes: dict[str, tuple[int, ...]], st_dtype: str, max_shard_bytes: int | None
) -> list[list[str]]:
    """Consecutive groups of tensor names, each under max_shard_bytes (one tensor may exceed)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = TensorInfo(st_dtype, shape, "").nbytes
        if max_shard_bytes is not None and shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
