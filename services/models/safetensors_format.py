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
from collections.abc import Callable, Iterable
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
# A header larger than this is corruption, not a model (safetensors itself caps it lower).
MAX_HEADER_BYTES = 100 * 1024 * 1024
_LENGTH_PREFIX_BYTES = 8


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

    Raises InvalidCheckpoint when the header is truncated or malformed, or when a tensor's
    bytes would lie past the end of the file (a truncated download).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(_LENGTH_PREFIX_BYTES)
        if len(prefix) < _LENGTH_PREFIX_BYTES:
            raise InvalidCheckpoint(
                f"{path.name}: {size} bytes is too short for a safetensors file"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - _LENGTH_PREFIX_BYTES):
            raise InvalidCheckpoint(
                f"{path.name}: header claims {header_len} bytes but the file has {size} bytes "
                "(truncated or not a safetensors file)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidCheckpoint(
            f"{path.name}: safetensors header is not valid JSON: {exc}"
        ) from exc
    if not isinstance(header, dict):
        raise InvalidCheckpoint(f"{path.name}: safetensors header is not a JSON object")
    data_bytes = size - _LENGTH_PREFIX_BYTES - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path.name, name, entry, data_bytes)
    return tensors


def _tensor_info(file: str, name: str, entry: object, data_bytes: int) -> TensorInfo:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise InvalidCheckpoint(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BYTES:
        raise InvalidCheckpoint(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidCheckpoint(f"{where}: shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise InvalidCheckpoint(f"{where}: data_offsets {offsets!r} is not [start, end]")
    info = TensorInfo(dtype=dtype, shape=tuple(shape), file=file, data_offsets=tuple(offsets))
    start, end = offsets
    if not 0 <= start <= end or end - start != info.nbytes:
        raise InvalidCheckpoint(
            f"{where}: data_offsets {offsets} do not hold {info.nbytes} bytes of {dtype}{shape}"
        )
    if end > data_bytes:
        raise InvalidCheckpoint(
            f"{where}: data ends at byte {end} but the file holds only {data_bytes} data bytes "
            "(truncated file)"
        )
    return info


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


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
