"""The safetensors file format, both ways, without loading tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [start, end]}`` (offsets relative to
the end of the header), then the raw little-endian tensor bytes. Reading only the header
lets the control plane check a 100 GB checkpoint in milliseconds; writing chunk by chunk
keeps at most a few megabytes of any tensor in memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.models.errors import InvalidCheckpoint

# Bytes per element of every dtype the safetensors format names.
SAFETENSORS_DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# config.json dtype name -> safetensors dtype name, for the dtypes checkpoints are written in.
CONFIG_TO_SAFETENSORS_DTYPE: dict[str, str] = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
}
# The float dtypes a checkpoint's weights may be stored in (and decode_float_tensor reads).
FLOAT_DTYPES = ("F32", "F16", "BF16")
# Pieces tensor data is read in (read_range): big enough for few system calls, small
# enough that copying a 70B checkpoint's tensors never holds much of one in memory.
READ_CHUNK_BYTES = 8 << 20
# A header larger than this is corruption, not a model: the reference library's cap.
MAX_HEADER_BYTES = 100_000_000
_LENGTH_PREFIX_BYTES = 8
# Sizes the reference library computes in 64 bits; a tensor this large is a lying header.
_MAX_TENSOR_BYTES = 2**64


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: dtype (safetensors name, e.g. "BF16"), shape and file name."""

    dtype: str
    shape: tuple[int, ...]
    file: str
    # Byte range inside the file's data section (after the header).
    data_offsets: tuple[int, int] = (0, 0)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_DTYPE_BYTES[self.dtype]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names to TensorInfo from one file's header; tensor data is never read.

    Accepts what the reference ``safetensors`` library accepts: a UTF-8 JSON object of at
    most MAX_HEADER_BYTES whose ``__metadata__`` (optional, or null) maps strings to strings and
    whose tensors, in offset order, tile the data section exactly. Raises
    InvalidCheckpoint, naming the file and the problem, for anything else: a truncated
    or oversized header, invalid JSON, an unknown dtype, a malformed shape, offsets that
    overlap, leave gaps, disagree with the shape or lie past the end of the file.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(_LENGTH_PREFIX_BYTES)
        if len(prefix) < _LENGTH_PREFIX_BYTES:
            raise InvalidCheckpoint(
                f"{path.name}: {size} bytes is too short for a safetensors file"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise InvalidCheckpoint(
                f"{path.name}: header claims {header_len} bytes, more than the "
                f"{MAX_HEADER_BYTES} a safetensors header may have (corrupt or not a "
                "safetensors file)"
            )
        if header_len > size - _LENGTH_PREFIX_BYTES:
            raise InvalidCheckpoint(
                f"{path.name}: header claims {header_len} bytes but the file has "
                f"{size - _LENGTH_PREFIX_BYTES} after its {_LENGTH_PREFIX_BYTES}-byte length "
                "(truncated or not a safetensors file)"
            )
        raw = f.read(header_len)
    header = _parse_header(path.name, raw)
    data_bytes = size - _LENGTH_PREFIX_BYTES - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(path.name, entry)
            continue
        tensors[name] = _tensor_info(path.name, name, entry)
    _check_tiling(path.name, tensors, data_bytes)
    return tensors


def _parse_header(file: str, raw: bytes) -> dict[str, object]:
    """The header's JSON object; InvalidCheckpoint for anything but UTF-8 JSON holding an
    object (deep nesting and over-long numbers included, which Python's json refuses with
    RecursionError and ValueError)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidCheckpoint(f"{file}: safetensors header is not UTF-8: {exc}") from exc
    except RecursionError as exc:
        raise InvalidCheckpoint(
            f"{file}: safetensors header is not valid JSON: nested too deeply"
        ) from exc
    except ValueError as exc:  # json.JSONDecodeError and over-long integers
        raise InvalidCheckpoint(f"{file}: safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidCheckpoint(f"{file}: safetensors header is not a JSON object")
    return header


def _check_metadata(file: str, metadata: object) -> None:
    if metadata is None:  # the reference library reads null as no metadata
        return
    if not isinstance(metadata, dict) or not all(
        isinstance(value, str) for value in metadata.values()
    ):
        raise InvalidCheckpoint(
            f"{file}: __metadata__ must map names to strings, got {_shown(metadata)}"
        )


def _shown(value: object, limit: int = 80) -> str:
    """repr of a header value cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_info(file: str, name: str, entry: object) -> TensorInfo:
    where = f"{file}: tensor {_shown(name)}"
    if not isinstance(entry, dict):
        raise InvalidCheckpoint(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BYTES:
        raise InvalidCheckpoint(f"{where}: unknown dtype {_shown(dtype)}")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise InvalidCheckpoint(f"{where}: shape {_shown(shape)} is not a list of sizes")
    # The reference library computes sizes in 64 bits; past that a shape is a lie, and
    # refusing it early keeps a hostile shape from costing a huge multiplication.
    nbytes = SAFETENSORS_DTYPE_BYTES[dtype]
    for dim in shape:
        nbytes *= dim
        if nbytes >= _MAX_TENSOR_BYTES:
            raise InvalidCheckpoint(
                f"{where}: shape {_shown(shape)} of {dtype} is larger than any file"
            )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))):
        raise InvalidCheckpoint(
            f"{where}: data_offsets {_shown(offsets)} is not [start, end] byte offsets"
        )
    start, end = offsets
    if end < start or end - start != nbytes:
        raise InvalidCheckpoint(
            f"{where}: data_offsets {offsets} do not hold {nbytes} bytes of {dtype}{shape}"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), file=file, data_offsets=(start, end))


def _check_tiling(file: str, tensors: dict[str, TensorInfo], data_bytes: int) -> None:
    """The tensors, in offset order, must cover the data section exactly, as the
    reference library demands: an overlap or a gap means the header lies about where
    each tensor is; bytes past the last tensor, a file not written as the header says."""
    covered = 0
    for name, info in sorted(tensors.items(), key=lambda item: item[1].data_offsets):
        start, end = info.data_offsets
        if start != covered:
            problem = "overlaps the tensor before it" if start < covered else "leaves a gap"
            raise InvalidCheckpoint(
                f"{file}: tensor {_shown(name)}: data_offsets [{start}, {end}] {problem} "
                f"(the data before it ends at byte {covered})"
            )
        covered = end
    if covered > data_bytes:
        raise InvalidCheckpoint(
            f"{file}: tensor data ends at byte {covered} but the file holds only {data_bytes} "
            "data bytes (truncated file)"
        )
    if covered < data_bytes:
        raise InvalidCheckpoint(
            f"{file}: the tensors cover {covered} of the file's {data_bytes} data bytes "
            "(trailing bytes: not written as its header says)"
        )


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def decode_float_tensor(raw: bytes, dtype: str) -> np.ndarray:
    """float32 values of raw little-endian F32, F16 or BF16 bytes (exact: float32 holds
    every value of the other two)."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"cannot decode {dtype} bytes as float values")
    return np.frombuffer(raw, dtype="<f4" if dtype == "F32" else "<f2").astype(np.float32)


def data_start(path: Path) -> int:
    """File offset of the first tensor byte of a safetensors file (after its header)."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(_LENGTH_PREFIX_BYTES))
    return _LENGTH_PREFIX_BYTES + header_len


def read_range(
    path: Path, start: int, stop: int, chunk_bytes: int = READ_CHUNK_BYTES
) -> Iterator[bytes]:
    """Bytes ``[start, stop)`` of ``path`` in pieces of at most ``chunk_bytes``;
    InvalidCheckpoint when the file ends before ``stop``."""
    with path.open("rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0:
            chunk = f.read(min(chunk_bytes, left))
            if not chunk:
                raise InvalidCheckpoint(f"{path.name} ended {left} bytes early (truncated?)")
            left -= len(chunk)
            yield chunk


def read_tensor_chunks(directory: Path, info: TensorInfo, chunk_elements: int) -> Iterator[bytes]:
    """The stored bytes of one tensor of a checkpoint directory, ``chunk_elements``
    elements at a time (the last piece may hold fewer), read straight from its file."""
    path = directory / info.file
    base = data_start(path)
    first, last = info.data_offsets
    chunk_bytes = chunk_elements * SAFETENSORS_DTYPE_BYTES[info.dtype]
    return read_range(path, base + first, base + last, chunk_bytes)


def encode_tensor(values: np.ndarray, dtype: str) -> bytes:
    """Raw little-endian bytes of float values in a safetensors float dtype (F32/F16/BF16)."""
    if dtype == "BF16":
        return float32_to_bfloat16_bits(values).astype("<u2").tobytes()
    numpy_dtype = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}.get(dtype)
    if numpy_dtype is None:
        raise ValueError(f"cannot encode float values as {dtype}")
    return np.ascontiguousarray(values, dtype=numpy_dtype).tobytes()


def write_safetensors(
    path: Path,
    layout: Iterable[tuple[str, str, tuple[int, ...]]],
    tensor_chunks: Callable[[str], Iterable[bytes | memoryview]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a safetensors file; returns the number of data bytes written.

    ``layout`` lists (name, safetensors dtype, shape) in file order; ``tensor_chunks(name)``
    is called once per tensor, in that order, and yields the tensor's bytes in pieces, so
    callers never need a whole tensor (let alone a whole model) in memory.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    entries = list(layout)
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces so tensor data starts 8-byte aligned, as the reference writer does.
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, dtype, shape in entries:
            expected = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
            written = 0
            for chunk in tensor_chunks(name):
                written += f.write(chunk)
            if written != expected:
                raise ValueError(f"tensor {name!r}: got {written} bytes, expected {expected}")
    return offset
