"""Safetensors files whose header lies: each is InvalidCheckpoint naming the file and the
problem (INVALID_ARGUMENT at registration), never a raw TypeError, RecursionError or
MemoryError; what the reference ``safetensors`` library accepts, the parser accepts."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

from fingerprint_svc.registry import inspect_checkpoint
from services.errors import InvalidArgument
from services.models.errors import InvalidCheckpoint
from services.models.safetensors_format import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPE_BYTES,
    read_safetensors_header,
)

FILE = "model.safetensors"
HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _tensor(start: int, end: int, shape=(2,), dtype="F32") -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}


def _file(path: Path, header: bytes, data: bytes = b"", declared: int | None = None) -> Path:
    size = len(header) if declared is None else declared
    path.write_bytes(struct.pack("<Q", size) + header + data)
    return path


def _json(header) -> bytes:
    return json.dumps(header).encode()


# (case, header bytes, data bytes, declared header length or None, phrase in the error)
LYING_HEADERS = [
    ("length past the end", b"{}", b"", 1000, "claims 1000 bytes but the file has 2 after its"),
    ("length of 10^12", b"{}", b"", 10**12, f"more than the {MAX_HEADER_BYTES}"),
    ("length 2^64-1", b"{}", b"", 2**64 - 1, "more than the"),
    ("not JSON", b"{ not json", b"", None, "not valid JSON"),
    ("empty header", b"", b"", None, "not valid JSON"),
    ("JSON array", b"[1, 2]", b"", None, "not a JSON object"),
    ("JSON string", b'"weights"', b"", None, "not a JSON object"),
    ("latin-1 bytes", b'{"\xe9": 1}', b"", None, "not UTF-8"),
    ("UTF-16", '{"a": {}}'.encode("utf-16"), b"", None, "not UTF-8"),
    ("nested 100k deep", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None, "deeply"),
    ("5000-digit number", b'{"a": {"shape": [' + b"9" * 5000 + b"]}}", b"", None, "valid JSON"),
    ("entry not an object", _json({"w": [0, 8]}), bytes(8), None, "not an object"),
    ("unknown dtype", _json({"w": _tensor(0, 8, dtype="F128")}), bytes(8), None, "'F128'"),
    ("dtype a list", _json({"w": _tensor(0, 8, dtype=["F32"])}), bytes(8), None, "dtype"),
    ("dtype missing", _json({"w": {"shape": [2], "data_offsets": [0, 8]}}), bytes(8), None, "None"),
    ("float shape", _json({"w": _tensor(0, 8, shape=(2.0,))}), bytes(8), None, "list of sizes"),
    ("negative dim", _json({"w": _tensor(0, 8, shape=(-2,))}), bytes(8), None, "list of sizes"),
    ("bool dim", _json({"w": _tensor(0, 4, shape=(True,))}), bytes(4), None, "list of sizes"),
    ("shape a string", _json({"w": _tensor(0, 8, shape="2")}), bytes(8), None, "list of sizes"),
    ("shape past 64 bits", _json({"w": _tensor(0, 8, (2**40, 2**40))}), bytes(8), None, "larger"),
    (
        "offsets of 3",
        _json({"w": {**_tensor(0, 8), "data_offsets": [0, 4, 8]}}),
        bytes(8),
        None,
        "not [start, end]",
    ),
    ("negative offset", _json({"w": _tensor(-8, 0)}), bytes(8), None, "not [start, end]"),
    ("float offset", _json({"w": _tensor(0.0, 8)}), bytes(8), None, "not [start, end]"),
    ("begin > end", _json({"w": _tensor(8, 0)}), bytes(8), None, "do not hold 8 bytes"),
    ("size != shape x dtype", _json({"w": _tensor(0, 12)}), bytes(12), None, "do not hold 8"),
    ("end past the data", _json({"w": _tensor(0, 8)}), bytes(4), None, "truncated"),
    ("overlapping", _json({"a": _tensor(0, 8), "b": _tensor(4, 12)}), bytes(12), None, "overlaps"),
    (
        "same bytes twice",
        _json({"a": _tensor(0, 8), "b": _tensor(0, 8)}),
        bytes(8),
        None,
        "overlaps",
    ),
    ("gap", _json({"a": _tensor(0, 8), "b": _tensor(16, 24)}), bytes(24), None, "gap"),
    ("trailing bytes", _json({"a": _tensor(0, 8)}), bytes(16), None, "trailing bytes"),
    ("metadata not strings", _json({"__metadata__": {"format": 1}}), b"", None, "__metadata__"),
    ("metadata a list", _json({"__metadata__": ["pt"]}), b"", None, "__metadata__"),
]


@pytest.mark.parametrize(
    "header,data,declared,phrase",
    [case[1:] for case in LYING_HEADERS],
    ids=[case[0] for case in LYING_HEADERS],
)
def test_a_lying_header_is_invalid_checkpoint_naming_file_and_problem(
    tmp_path, header, data, declared, phrase
):
    path = _file(tmp_path / FILE, header, data, declared)
    with pytest.raises(InvalidCheckpoint) as err:
        read_safetensors_header(path)
    assert FILE in str(err.value) and phrase in str(err.value)
    # The reference library refuses the same files.
    with pytest.raises(SafetensorError), safe_open(str(path), framework="numpy"):
        pass


def test_registration_turns_a_lying_header_into_invalid_argument(tmp_path):
    from services.models.checkpoint import create_checkpoint

    directory = create_checkpoint(
        tmp_path / "liar", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    weights = directory / FILE
    weights.write_bytes(weights.read_bytes() + bytes(8))
    with pytest.raises(InvalidArgument) as err:
        inspect_checkpoint(directory, "checkpoint 'liar'")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "checkpoint 'liar'" in str(err.value) and "trailing bytes" in str(err.value)


def test_what_the_reference_accepts_is_accepted(tmp_path):
    """Zero-sized tensors sharing an offset, keys beyond the three, whitespace before the
    object: all valid safetensors."""
    header = {
        "__metadata__": {"format": "pt"},
        "empty": _tensor(0, 0, shape=(0, 3)),
        "also_empty": _tensor(0, 0, shape=(0,)),
        "w": {**_tensor(0, 8), "comment": "extra keys are ignored"},
    }
    path = _file(tmp_path / FILE, b"  " + _json(header), bytes(8))
    tensors = read_safetensors_header(path)
    assert sorted(tensors) == ["also_empty", "empty", "w"]
    assert tensors["w"].data_offsets == (0, 8)
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors)


def _read(path: Path) -> dict | InvalidCheckpoint:
    try:
        return read_safetensors_header(path)
    except InvalidCheckpoint as exc:
        return exc


@HYPOTHESIS
@given(st.binary(max_size=256))
def test_arbitrary_bytes_are_parsed_or_invalid_checkpoint(tmp_path, raw):
    _read(_write(tmp_path, raw))


def _write(tmp_path: Path, raw: bytes) -> Path:
    path = tmp_path / FILE
    path.write_bytes(raw)
    return path


@HYPOTHESIS
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_arbitrary_header_bytes_are_parsed_or_invalid_checkpoint(tmp_path, header, data):
    _read(_file(tmp_path / FILE, header, data))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_sizes = st.integers(min_value=-2, max_value=40)
_entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*SAFETENSORS_DTYPE_BYTES, "F128", "f32", ""]) | _json_values,
        "shape": st.lists(_sizes, max_size=3) | _json_values,
        "data_offsets": st.lists(_sizes, min_size=2, max_size=2) | _json_values,
    }
)
_headers = st.dictionaries(
    st.sampled_from(["a", "b", "c", "__metadata__"]), _entries | _json_values, max_size=4
)


@HYPOTHESIS
@given(_headers, st.integers(min_value=0, max_value=48))
def test_structured_headers_agree_with_the_reference_library(tmp_path, header, data_bytes):
    """Near-valid headers (right keys, values a little off): accepted exactly when the
    reference library opens the file, else InvalidCheckpoint."""
    try:
        raw = json.dumps(header, allow_nan=False).encode()
    except ValueError:  # NaN/Infinity are not JSON; covered by the raw-bytes test
        return
    path = _file(tmp_path / FILE, raw, bytes(data_bytes))
    ours = _read(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            reference = set(f.keys())
    except SafetensorError:
        reference = None
    if reference is None:
        assert isinstance(ours, InvalidCheckpoint)
    else:
        assert not isinstance(ours, InvalidCheckpoint), ours
        assert set(ours) == reference


@st.composite
def _layouts(draw) -> tuple[dict, int]:
    """A header whose tensors tile the data section (zero-sized ones included), then at
    most one lie: an offset moved, a tensor's size changed, bytes added or cut."""
    header: dict[str, object] = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.none() | st.just({"format": "pt"}))
    offset = 0
    for index in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(SAFETENSORS_DTYPE_BYTES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = SAFETENSORS_DTYPE_BYTES[dtype] * math.prod(shape)
        header[f"t{index}"] = _tensor(offset, offset + size, shape, dtype)
        offset += size
    data_bytes = offset
    names = [name for name in header if name != "__metadata__"]
    lie = draw(st.sampled_from(["none", "offset", "data"]))
    if lie == "offset" and names:
        entry = header[draw(st.sampled_from(names))]
        which = draw(st.integers(0, 1))
        entry["data_offsets"][which] = max(
            0, entry["data_offsets"][which] + draw(st.integers(-3, 3))
        )
    elif lie == "data":
        data_bytes = max(0, data_bytes + draw(st.integers(-3, 3)))
    return header, data_bytes


@HYPOTHESIS
@given(_layouts())
def test_tiled_layouts_and_single_lies_agree_with_the_reference_library(tmp_path, layout):
    header, data_bytes = layout
    path = _file(tmp_path / FILE, _json(header), bytes(data_bytes))
    ours = _read(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            reference = set(f.keys())
    except SafetensorError:
        reference = None
    assert (reference is None) == isinstance(ours, InvalidCheckpoint), (ours, reference)
    if reference is not None:
        assert set(ours) == reference
