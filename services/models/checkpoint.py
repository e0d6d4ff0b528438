"""Hugging Face checkpoint directories: read, validate and (for tests) create them.

A checkpoint directory holds ``config.json``, the safetensors weights transformers loads
from it (:func:`weight_files`: ``model.safetensors``, or the shards
``model.safetensors.index.json`` names) and a ``tokenizer.json``. Validation reads the
config and the safetensors headers, and tensor data only where a config ties the LM head
over a checkpoint that also holds one (the two are compared chunk by chunk, see
services.models.tied_head), so it is cheap enough to run when a model is registered and
again before a worker loads it. At registration it also loads the tokenizer and compiles
the chat template (tokenizer_files).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from services.models.arch import ArchSpec
from services.models.checkpoint_files import (
    CONFIG_FILE,
    EXPLICIT_WEIGHTS_FIELD,
    SHARD_INDEX_FILE,
    read_config_file,
    read_safetensors_index,
    weight_files,
    weights_dtype,
)
from services.models.errors import InvalidCheckpoint, InvalidConfig, UnsupportedArchitecture
from services.models.families import FAMILIES, ConfigRequest, parse_config
from services.models.random_weights import RandomWeights
from services.models.safetensors_format import (
    CONFIG_TO_SAFETENSORS_DTYPE,
    FLOAT_DTYPES,
    TensorInfo,
    write_safetensors,
)
from services.models.special_tokens import GENERATION_CONFIG_FILE, generation_eos_ids
from services.models.tied_head import is_duplicate_head, resolve_tied_head
from services.models.tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer
from services.models.tokenizer_files import TOKENIZER_FILE, check_tokenizer_files

__all__ = [
    "CONFIG_FILE",
    "CheckpointDirectoryNotEmpty",
    "TOKENIZER_FILE",
    "missing_tokenizer",
    "InvalidCheckpoint",
    "InvalidConfig",
    "TensorInfo",
    "UnsupportedArchitecture",
    "ValidatedCheckpoint",
    "build_tokenizer",
    "create_checkpoint",
    "read_config",
    "weights_dtype",
    "read_safetensors_index",
    "validate_checkpoint",
    "weight_files",
    "write_checkpoint",
]


class CheckpointDirectoryNotEmpty(FileExistsError):
    """A checkpoint is not written into a non-empty ``directory`` unless asked to; the
    CLI says how its users ask (``--force``), this message how a Python caller does."""

    def __init__(self, directory: Path):
        super().__init__(f"{str(directory)!r} is not empty; pass overwrite=True to replace it")
        self.directory = directory


@dataclass(frozen=True)
class ValidatedCheckpoint:
    """A checkpoint whose config and tensor headers agree; weight_bytes as stored on disk."""

    spec: ArchSpec
    tensors: dict[str, TensorInfo]
    weight_bytes: int
    has_tokenizer: bool


def read_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory; a config that names no dtype
    gets the weights' (:func:`weights_dtype`), as transformers loads it. Without
    ``transformers_weights``, which says where this directory's weights lie (see
    :func:`weight_files`), not what the model is: transformers' ``save_pretrained`` drops
    it too, so a config written from this one (a fingerprint's) names no missing file."""
    directory = Path(checkpoint_dir)
    config = read_config_file(directory)
    config.pop(EXPLICIT_WEIGHTS_FIELD, None)
    if config.get("dtype") is None and config.get("torch_dtype") is None:
        found = weights_dtype(directory)
        if found is not None:
            config["dtype"] = found
    return config


# The files of transformers' slow tokenizers, which its converter turns into tokenizer.json.
_SLOW_TOKENIZER_FILES = (("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))


def missing_tokenizer(directory: Path) -> InvalidCheckpoint:
    """The error for a checkpoint without ``tokenizer.json``; where the checkpoint has a
    slow tokenizer's files instead, it says how transformers writes the fast one."""
    message = f"{TOKENIZER_FILE} is missing from {str(directory)!r}"
    slow = next(
        (files for files in _SLOW_TOKENIZER_FILES if all((directory / f).is_file() for f in files)),
        None,
    )
    if slow:
        message += (
            f": it has a slow tokenizer's {' and '.join(slow)}, and iserve reads the fast "
            f"tokenizer's {TOKENIZER_FILE}; transformers writes it beside them with "
            f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    return InvalidCheckpoint(message)


def served_spec(checkpoint_dir: str | Path) -> ArchSpec:
    """The checkpoint's spec as it is served: its config's, with the LM head untied where
    the checkpoint holds a head of its own (:mod:`services.models.tied_head`). Reads the
    headers, and both head tensors only where the config ties them."""
    directory = Path(checkpoint_dir)
    spec = parse_config(read_config(directory))
    return resolve_tied_head(directory, spec, read_safetensors_index(directory))


def validate_checkpoint(
    checkpoint_dir: str | Path, *, require_tokenizer: bool = True
) -> ValidatedCheckpoint:
    """Check that a checkpoint can be served; every error names the field, tensor or file
    at fault.

    The config must describe a supported architecture; every tensor it implies must be
    present with exactly that shape in a float dtype; no other tensors may be present
    except harmless ones (rotary ``inv_freq`` buffers, GPT-J's saved attention masks, an
    LM head duplicating tied embeddings). A config that ties the LM head over a
    checkpoint holding a head of other values gets a spec with it untied, as transformers
    loads it (:mod:`services.models.tied_head`). Unless ``require_tokenizer`` is False
    (the loader, which reads weights only), ``tokenizer.json`` must exist, load, and fit
    the vocabulary, and the chat template must compile
    (:mod:`services.models.tokenizer_files`).
    """
    directory = Path(checkpoint_dir)
    spec = parse_config(read_config(directory))
    tensors = read_safetensors_index(directory)
    spec = resolve_tied_head(directory, spec, tensors)
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
        if info.dtype not in FLOAT_DTYPES:
            raise InvalidCheckpoint(
                f"tensor {name!r} has dtype {info.dtype}; expected one of {list(FLOAT_DTYPES)}"
            )
    extra = [
        name
        for name in tensors
        if name not in expected
        and not spec.is_ignorable_tensor(name)
        and not is_duplicate_head(spec, name)
    ]
    if extra:
        raise InvalidCheckpoint(
            f"checkpoint has unexpected tensor(s): {', '.join(sorted(extra)[:5])}"
        )
    # What the worker reads at load: a generation_config.json that is JSON but no
    # object was registered, and every deploy of it failed.
    generation_eos_ids(directory, spec.vocab_size)
    has_tokenizer = (directory / TOKENIZER_FILE).is_file()
    if require_tokenizer:
        if not has_tokenizer:
            raise missing_tokenizer(directory)
        check_tokenizer_files(directory, spec)
    return ValidatedCheckpoint(
        spec=spec,
        tensors={name: tensors[name] for name in expected},
        weight_bytes=sum(tensors[name].nbytes for name in expected),
        has_tokenizer=has_tokenizer,
    )


# The chat template written into tokenizer_config.json (``chat_template`` None: none),
# a plain role-tagged layout in the jinja2 form transformers' apply_chat_template renders.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tokenizer_size(directory: str | Path) -> int:
    """How many ids the checkpoint's ``tokenizer.json`` has text for (added tokens
    included)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json")).get_vocab_size()


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
    norm_eps: float | None = None,
    sliding_window: int | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a randomly initialised Hugging Face checkpoint of any family; return its directory.

    ``arch`` is "llama", "mistral" (with an optional ``sliding_window``), "qwen2",
    "falcon" or "gptj". ``num_kv_heads`` defaults to ``num_heads``; for Falcon one KV head
    gives Falcon-7B's multi-query design and anything between one and ``num_heads`` gives
    Falcon-40B's grouped one. ``intermediate_size`` and ``norm_eps`` default to the
    family's usual choice (8/3 × hidden rounded up to 32 for SwiGLU families, 4 × hidden
    otherwise). ``vocab_size`` defaults to the tokenizer's; it may be larger (padding rows)
    but not smaller. ``config_overrides`` sets or replaces config fields last (e.g.
    ``{"parallel_attn": False}`` or GPT-J's ``{"rotary_dim": 8}``); the result must still
    be a config iserve supports. Weights are written as :func:`write_checkpoint` does.
    """
    if arch not in FAMILIES:
        raise UnsupportedArchitecture(
            f"create_checkpoint writes one of {sorted(FAMILIES)}, not {arch!r}"
        )
    if sliding_window is not None and arch != "mistral":
        raise InvalidConfig("sliding_window is only meaningful for arch='mistral'")
    tokenizer = build_tokenizer()
    request = ConfigRequest(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=tokenizer.get_vocab_size() if vocab_size is None else vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        rope_theta=rope_theta,
        norm_eps=norm_eps,
        sliding_window=sliding_window,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
    )
    config = FAMILIES[arch].build_config(request)
    config.update(config_overrides or {})
    return write_checkpoint(
        out_dir,
        config,
        seed=seed,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        chat_template=chat_template,
        progress=progress,
    )


def write_checkpoint(
    out_dir: str | Path,
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``config`` as ``config.json`` with random weights for every tensor it implies,
    plus the small test tokenizer, and return the directory.

    The weights are streamed chunk by chunk (see services.models.random_weights), so a
    full-sized preset needs only megabytes of memory; the same config and seed always give
    the same bytes. The config's vocabulary must hold the tokenizer's ids. With
    ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000n.safetensors``
    shards plus an index, as transformers does. Refuses to write into a non-empty
    directory unless ``overwrite`` is True. ``chat_template`` goes into
    tokenizer_config.json (None: the checkpoint has none). ``progress(done, total)`` is
    told the weight bytes written so far. OSError (ENOSPC), before anything is written,
    when the disk cannot hold the weights.
    """
    directory = Path(out_dir)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise CheckpointDirectoryNotEmpty(directory)
    spec = parse_config(config)  # rejects inconsistent sizes before writing
    tokenizer = build_tokenizer()
    if spec.vocab_size < tokenizer.get_vocab_size():
        raise InvalidConfig(
            f"vocab_size {spec.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.get_vocab_size()}"
        )
    stale = [*directory.glob("*.safetensors"), directory / SHARD_INDEX_FILE]
    _check_disk_space(directory, spec.weight_bytes(), stale)
    directory.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.unlink(missing_ok=True)
    _write_random_weights(
        directory,
        spec,
        CONFIG_TO_SAFETENSORS_DTYPE[spec.torch_dtype],
        seed,
        max_shard_bytes,
        progress,
    )
    _write_json(directory / CONFIG_FILE, dict(config))
    eos = list(spec.eos_token_ids)
    _write_json(
        directory / GENERATION_CONFIG_FILE,
        {
            "bos_token_id": spec.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "do_sample": False,
        },
    )
    # Written here, not by the library, which takes the path as UTF-8 whatever the locale.
    (directory / TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
            **({"chat_template": chat_template} if chat_template else {}),
        },
    )
    return directory


# Headers, config, tokenizer: what a checkpoint holds beyond its tensors, with room to spare.
_FILES_MARGIN_BYTES = 64 << 20


def _check_disk_space(directory: Path, weight_bytes: int, stale: list[Path]) -> None:
    """OSError (ENOSPC) when the disk under ``directory`` cannot hold ``weight_bytes`` of
    weights, counting the ``stale`` files the write replaces as free: a full-size preset
    is hundreds of GiB, and a disk filled half-way leaves a broken checkpoint and a full
    disk behind."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    usage = shutil.disk_usage(existing)
    if usage.total == 0:  # /proc, /sys: "0.0 GiB free" said nothing of why
        _refuse(
            errno.EROFS,
            f"{str(directory)!r} is on a filesystem with no storage ({str(existing)!r} is "
            "in a kernel pseudo-filesystem such as /proc or /sys): write the checkpoint "
            "to a disk",
        )
    if not os.access(existing, os.W_OK):
        _refuse(errno.EACCES, f"{str(directory)!r}: {str(existing)!r} is not writable by you")
    free = usage.free
    free += sum(path.stat().st_size for path in stale if path.is_file())
    needed = weight_bytes + _FILES_MARGIN_BYTES
    if needed > free:
        _refuse(
            errno.ENOSPC,
            f"{str(directory)!r}: the checkpoint needs {needed / 2**30:.1f} GiB and its disk "
            f"has {free / 2**30:.1f} GiB free (--layers writes fewer layers)",
        )


def _refuse(code: int, message: str) -> NoReturn:
    """An OSError with errno ``code`` whose text is ``message`` alone (no "[Errno n]")."""
    refused = OSError(message)
    refused.errno = code
    raise refused


def _write_random_weights(
    directory: Path,
    spec: ArchSpec,
    st_dtype: str,
    seed: int,
    max_shard_bytes: int | None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    tensors = {tensor.name: tensor for tensor in spec.checkpoint_tensors()}
    shapes = {name: tensor.shape for name, tensor in tensors.items()}
    shards = _split_into_shards(shapes, st_dtype, max_shard_bytes)
    weights = RandomWeights(seed, st_dtype)
    weight_total, done = spec.weight_bytes(), 0

    def tensor_chunks(name: str) -> Iterator[bytes | memoryview]:
        nonlocal done
        # The engine parameter a tensor fills says what it is, whatever the family calls it.
        target = tensors[name].targets[0][0]
        kind = (
            "ones"
            if target.endswith("norm.weight")
            else "zeros"
            if target.endswith(".bias")
            else "normal"
        )
        for chunk in weights.chunks(shapes[name], kind):
            yield chunk
            if progress is not None:
                done += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                progress(done, weight_total)

    if len(shards) == 1:
        names = {"model.safetensors": shards[0]}
    else:
        total = len(shards)
        names = {f"model-{i + 1:05d}-of-{total:05d}.safetensors": s for i, s in enumerate(shards)}
    total_bytes = 0
    for file_name, shard in names.items():
        layout = [(name, st_dtype, shapes[name]) for name in shard]
        total_bytes += write_safetensors(directory / file_name, layout, tensor_chunks)
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
