"""Which files of a Hugging Face checkpoint directory hold its config and its weights, as
transformers' ``from_pretrained`` (5.x) chooses them, and what those files say: the raw
``config.json``, the weight files in transformers' order (:func:`weight_files`), their
tensors' headers (:func:`read_safetensors_index`) and the dtype transformers loads them
in when the config names none (:func:`weights_dtype`). Every reader of a checkpoint's
weights in iserve goes through :func:`weight_files`, so leftovers beside them (a re-save
with another shard size leaves the previous ``model.safetensors`` or index behind) are
ignored everywhere, as transformers ignores them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.files import FileTooLarge, NotRegularFile, read_regular_file
from services.models import json_text
from services.models.errors import InvalidCheckpoint
from services.models.safetensors_format import (
    CONFIG_TO_SAFETENSORS_DTYPE,
    TensorInfo,
    read_safetensors_header,
)

__all__ = [
    "CONFIG_FILE",
    "EXPLICIT_WEIGHTS_FIELD",
    "SHARD_INDEX_FILE",
    "WEIGHTS_FILE",
    "read_config_file",
    "read_safetensors_index",
    "weight_files",
    "weights_dtype",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"
# Named chat templates, one file each (transformers' save_pretrained writes them here).
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The config.json field naming the weights file or shard index transformers loads instead
# of WEIGHTS_FILE and SHARD_INDEX_FILE (from_pretrained's transformers_explicit_filename).
EXPLICIT_WEIGHTS_FIELD = "transformers_weights"
_INDEX_SUFFIX = ".safetensors.index.json"


# The largest config.json read (4 MiB): transformers' are a few kilobytes, a label map
# of thousands of classes some hundreds.
MAX_CONFIG_BYTES = 4 << 20


# The largest of a checkpoint's other JSON and text files read whole (tokenizer.json,
# a shard index, generation_config.json): a 256k-token vocabulary's tokenizer.json is
# some 30 MB.
MAX_CHECKPOINT_TEXT_BYTES = 256 << 20


def read_checkpoint_text(path: Path, limit: int = MAX_CHECKPOINT_TEXT_BYTES) -> str:
    """The UTF-8 text of the checkpoint file ``path`` (:func:`read_regular_file`):
    InvalidCheckpoint naming it when it is no regular file or holds more than ``limit``
    bytes. A named pipe as tokenizer_config.json held the model service's event loop,
    every model call with it, and each worker start for 120 s; a 600 MB one took 1.3 GB
    to register (a tester). OSError (no such file, say) and UnicodeDecodeError as
    reading raises them."""
    where = f"{path.name} in {str(path.parent)!r}"
    try:
        data = read_regular_file(path, limit)
    except NotRegularFile:
        raise InvalidCheckpoint(f"{where} is not a regular file") from None
    except FileTooLarge as exc:
        raise InvalidCheckpoint(f"{where} is {exc.size} bytes, more than {limit}") from None
    return data.decode("utf-8")


def read_config_file(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``directory`` as it is on disk; InvalidCheckpoint
    when the directory or file is missing or the file is not a JSON object."""
    if directory.exists() and not directory.is_dir():
        raise InvalidCheckpoint(
            f"{str(directory)!r} is a file, not a checkpoint directory: a checkpoint is the "
            f"directory that holds {CONFIG_FILE} and the weights"
        )
    if not directory.is_dir():
        raise InvalidCheckpoint(f"checkpoint directory {str(directory)!r} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise InvalidCheckpoint(f"{CONFIG_FILE} is missing from {str(directory)!r}")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        # Parsed on the model service's event loop: a probe's 40 MB one held every
        # other model call for 11 s.
        raise InvalidCheckpoint(
            f"{CONFIG_FILE} in {str(directory)!r} is {size} bytes, more than "
            f"{MAX_CONFIG_BYTES}: a model's configuration is a few kilobytes"
        )
    return read_json_object(path)


def read_json_object(path: Path, limit: int = MAX_CHECKPOINT_TEXT_BYTES) -> dict:
    """The JSON object in checkpoint file ``path`` (at most ``limit`` bytes); InvalidCheckpoint
    naming the file and its directory when it cannot be read, is not UTF-8 JSON, or holds
    no object."""
    where = f"{path.name} in {str(path.parent)!r}"
    try:
        value = json_text.loads(read_checkpoint_text(path, limit))
    except InvalidCheckpoint:  # a ValueError too, that says what is wrong already
        raise
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidCheckpoint(f"{where} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot read {where}: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidCheckpoint(f"{where} is not a JSON object")
    return value


_CONFIG_DTYPE_OF = {code: name for name, code in CONFIG_TO_SAFETENSORS_DTYPE.items()}


def weights_dtype(checkpoint_dir: str | Path) -> str | None:
    """The dtype transformers' ``from_pretrained`` (whose default is ``dtype="auto"``)
    loads a checkpoint in when its config names none: the ``dtype`` in the metadata of
    the shard index it loads, where there is one, else the first floating-point tensor's
    of the first file it loads (:func:`weight_files`), in the order safetensors'
    ``keys()`` lists them (by name). None without such weights or a float tensor iserve
    reads (then the config's default, float32, stands)."""
    directory = Path(checkpoint_dir)
    chosen = _chosen_weights(directory)
    if chosen is None:
        return None
    if isinstance(chosen.index_metadata.get("dtype"), str):
        return chosen.index_metadata["dtype"]
    header = read_safetensors_header(directory / chosen.files[0])
    for name in sorted(header):
        if header[name].dtype in _CONFIG_DTYPE_OF:
            return _CONFIG_DTYPE_OF[header[name].dtype]
    return None


def weight_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files transformers' ``from_pretrained`` (5.x,
    ``_get_resolved_checkpoint_files``) loads from a checkpoint directory, in its order,
    whatever other files lie beside them (a re-save with another shard size leaves the
    previous ``model.safetensors`` or index behind, and transformers ignores it): the
    file or shard index that ``config.json``'s ``transformers_weights`` names, else
    ``model.safetensors``, else the shards ``model.safetensors.index.json`` names, sorted
    by name. Every reader of a checkpoint's weights goes through this.

    Raises InvalidCheckpoint when there is none of these, ``transformers_weights`` names
    something else, or the index is malformed or names a missing shard.
    """
    directory = Path(checkpoint_dir)
    return [directory / name for name in _required_weights(directory).files]


@dataclass(frozen=True)
class _ChosenWeights:
    files: tuple[str, ...]  # relative to the checkpoint directory, in transformers' order
    index_metadata: dict[str, Any]  # the shard index's "metadata"; empty for one file


def _required_weights(directory: Path) -> _ChosenWeights:
    chosen = _chosen_weights(directory)
    if chosen is None:
        for name in (WEIGHTS_FILE, SHARD_INDEX_FILE):
            if (directory / name).exists():  # there, but a directory, FIFO or device
                raise InvalidCheckpoint(f"{name} in {str(directory)!r} is not a regular file")
        others = sorted(path.name for path in directory.glob("*.safetensors"))
        raise InvalidCheckpoint(
            f"no *.safetensors files in {str(directory)!r} that transformers loads: it "
            f"reads {WEIGHTS_FILE}, or the shards {SHARD_INDEX_FILE} names"
            + (
                f", not {', '.join(others)} unless {CONFIG_FILE} names the file in "
                f"{EXPLICIT_WEIGHTS_FIELD}"
                if others
                else ""
            )
        )
    return chosen


def _chosen_weights(directory: Path) -> _ChosenWeights | None:
    """What :func:`weight_files` promises, None where transformers finds no weights."""
    explicit = read_config_file(directory).get(EXPLICIT_WEIGHTS_FIELD)
    if explicit is not None:
        source = _explicit_weights(directory, explicit)
    elif (directory / WEIGHTS_FILE).is_file():
        source = WEIGHTS_FILE
    elif (directory / SHARD_INDEX_FILE).is_file():
        source = SHARD_INDEX_FILE
    else:
        return None
    if source.endswith(_INDEX_SUFFIX):
        return _read_shard_index(directory, source)
    return _ChosenWeights((source,), {})


def _explicit_weights(directory: Path, name: Any) -> str:
    """``transformers_weights``, checked as transformers checks it, and present."""
    field = f"{CONFIG_FILE}'s {EXPLICIT_WEIGHTS_FIELD}"
    if not isinstance(name, str) or not name.endswith((".safetensors", _INDEX_SUFFIX)):
        raise InvalidCheckpoint(
            f"{field} must name a *.safetensors file or a *{_INDEX_SUFFIX} index, got {name!r}"
        )
    if not _within(name):
        raise InvalidCheckpoint(f"{field} {name!r} is outside the checkpoint directory")
    if not (directory / name).is_file():
        raise InvalidCheckpoint(f"{field} names {name!r}, which is missing")
    return name


def _within(name: str) -> bool:
    """Whether the file name ``name``, joined to a directory, stays inside it (links
    aside: ``services.engine_rules.resolve_checkpoint`` follows those)."""
    if not name or "\0" in name or os.path.isabs(name):
        return False
    parts = os.path.normpath(name).split(os.sep)
    return parts[0] not in ("..", ".", "")


def _read_shard_index(directory: Path, index_name: str) -> _ChosenWeights:
    try:
        index = json_text.loads(read_checkpoint_text(directory / index_name))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidCheckpoint(f"{index_name} is not valid JSON: {exc}") from exc
    # transformers reads index["metadata"] and the shards index["weight_map"] names.
    fields = index if isinstance(index, dict) else {}
    metadata, weight_map = fields.get("metadata"), fields.get("weight_map")
    names = list(weight_map.values()) if isinstance(weight_map, dict) else []
    if not isinstance(metadata, dict) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidCheckpoint(
            f'{index_name} is malformed: it needs a "metadata" object and a "weight_map" '
            "from tensor names to shard files"
        )
    shards = tuple(sorted(set(names)))
    outside = [name for name in shards if not _within(name)]
    if outside:
        # Joined to the directory, an absolute name replaces it, and ".." climbs out: a
        # probe's index named files elsewhere on the host, which were served, and one
        # error message quoted a text file's first bytes as a header length.
        raise InvalidCheckpoint(
            f"{index_name} names shards outside the checkpoint directory: {outside}"
        )
    missing = [name for name in shards if not (directory / name).is_file()]
    if missing:
        raise InvalidCheckpoint(f"shards named in {index_name} are missing: {missing}")
    return _ChosenWeights(shards, metadata)


def read_safetensors_index(checkpoint_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor in the weights transformers loads (:func:`weight_files`), from their
    headers only; files beside them are not read.

    Raises InvalidCheckpoint as :func:`weight_files` does, and when a header is corrupt
    or truncated or a tensor appears in two of those files.
    """
    directory = Path(checkpoint_dir)
    tensors: dict[str, TensorInfo] = {}
    for file in _required_weights(directory).files:
        for name, info in read_safetensors_header(directory / file).items():
            # The name as chosen (a shard may sit in a subdirectory), which readers join
            # to the directory.
            info = replace(info, file=file)
            if name in tensors:
                raise InvalidCheckpoint(
                    f"tensor {name!r} appears in both {tensors[name].file} and {info.file}"
                )
            tensors[name] = info
    return tensors
