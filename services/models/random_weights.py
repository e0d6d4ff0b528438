"""Deterministic random tensor bytes for synthetic checkpoints, produced in chunks.

Norm weights are ones, biases zeros and every other tensor N(0, 0.02²). A tensor of up to
``FRESH_LIMIT`` elements (everything in a test-sized model) is drawn afresh. A larger one
(a 7B model's 500 MB embedding) repeats a pool of ``POOL_ELEMENTS`` random values from a
random start: drawing and rounding billions of normals would take minutes, while what a
full-sized synthetic checkpoint is for (profiling time and memory) never looks at the
values. The pool's length is prime, so rows of a tiled matrix do not line up with each
other. Memory stays at a few pool sizes whatever the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from services.models.safetensors_format import SAFETENSORS_DTYPE_BYTES, encode_tensor

INIT_STD = 0.02
FRESH_LIMIT = 1 << 20
POOL_ELEMENTS = 4_194_301  # the largest prime below 2**22
_CONSTANT_CHUNK = 1 << 20


class RandomWeights:
    """Tensor bytes for one checkpoint: the same seed and call order give the same bytes."""

    def __init__(self, seed: int, dtype: str) -> None:
        self._rng = np.random.default_rng(seed)
        self._dtype = dtype  # safetensors name: "F32", "F16" or "BF16"
        self._pool: bytes | None = None

    def chunks(self, shape: tuple[int, ...], kind: str) -> Iterator[bytes | memoryview]:
        """The bytes of one tensor in pieces; kind is "ones", "zeros" or "normal"."""
        count = math.prod(shape)
        if kind in ("ones", "zeros"):
            yield from self._constant(count, 1.0 if kind == "ones" else 0.0)
        elif count <= FRESH_LIMIT:
            values = self._rng.standard_normal(count, dtype=np.float32) * np.float32(INIT_STD)
            yield encode_tensor(values, self._dtype)
        else:
            yield from self._tiled(count)

    def _constant(self, count: int, value: float) -> Iterator[bytes]:
        block = encode_tensor(np.full(min(count, _CONSTANT_CHUNK), value, np.float32), self._dtype)
        width = SAFETENSORS_DTYPE_BYTES[self._dtype]
        remaining = count
        while remaining:
            take = min(remaining, _CONSTANT_CHUNK)
            yield block[: take * width]
            remaining -= take

    def _tiled(self, count: int) -> Iterator[memoryview]:
        if self._pool is None:
            values = self._rng.standard_normal(POOL_ELEMENTS, dtype=np.float32)
            self._pool = encode_tensor(values * np.float32(INIT_STD), self._dtype)
        pool = memoryview(self._pool)
        width = SAFETENSORS_DTYPE_BYTES[self._dtype]
        start = int(self._rng.integers(POOL_ELEMENTS))
        remaining = count
        while remaining:
            take = min(remaining, POOL_ELEMENTS - start)
            yield pool[start * width : (start + take) * width]
            remaining -= take
            start = 0
