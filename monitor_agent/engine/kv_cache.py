"""A static KV cache: one K and one V buffer per layer, allocated once.

Each buffer is [max_batch, kv_heads, max_seq_len, head_dim]. A sequence owns one slot
(the first index) for its lifetime and writes the keys of position p at [slot, :, p].
Nothing is allocated per step; reads return views when the rows address consecutive
slots in order (one slot, or the whole batch in slot order), copies otherwise.

With int8 quantization (``kv_cache_quantization("int8")`` around the model's
``setup_caches``) K and V are stored as int8 with one bfloat16 scale per
(slot, head, position): the absolute maximum of that head's vector / 127. A vector is
quantized once, when it is written, and dequantized to the model dtype on every read,
so the resident cache shrinks to (head_dim + 2) / (4 · head_dim) of float32 (~3.9× smaller
at head_dim 64) and to (head_dim + 2) / (2 · head_dim) of bfloat16. Per-position scales
need no calibration and never clip a later token, which a per-(slot, head) scale fixed
at prefill would. Quantizing with the rounded bfloat16 scale itself makes the scale's
rounding cost nothing beyond int8's own half-step error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

# "none": K and V in the model dtype; "int8": quantized as described above.
KV_QUANTIZATIONS = ("none", "int8")
SCALE_DTYPE = torch.bfloat16
_INT8_MAX = 127

_quantization: ContextVar[str] = ContextVar("kv_cache_quantization", default="none")


@contextlib.contextmanager
def kv_cache_quantization(kind: str) -> Iterator[None]:
    """Within this block, new LayerKVCaches store K and V as ``kind`` ("none" or "int8").

    A context rather than a model argument so the model's ``setup_caches`` allocates the
    quantized buffers directly, never a full-precision cache first.
    """
    if kind not in KV_QUANTIZATIONS:
        raise ValueError(f"KV-cache quantization must be one of {KV_QUANTIZATIONS}, got {kind!r}")
    token = _quantization.set(kind)
    try:
        yield
    finally:
        _quantization.reset(token)


class LayerKVCache(nn.Module):
    def __init__(
        self,
        max_batch: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.dtype = dtype  # what update() takes and returns
        self.quantization = _quantization.get()
        shape = (max_batch, num_kv_heads, max_seq_len, head_dim)
        storage = torch.int8 if self.quantization == "int8" else dtype
        for name in ("keys", "values"):
            self.register_buffer(
                name, torch.zeros(shape, dtype=storage, device=device), persistent=False
            )
        if self.quantization == "int8":
            scale_shape = (*shape[:-1], 1)
            for name in ("key_scales", "value_scales"):
                self.register_buffer(
                    name,
                    torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device),
                    persistent=False,
                )

    def update(
        self, address: CacheAddress, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, head_dim]; return every cached key and value of the
        addressed slots up to address.kv_len, as [B, kv_heads, kv_len, head_dim]."""
        if self.quantization == "int8":
            k_q, k_scale = _quantize(k)
            v_q, v_scale = _quantize(v)
            _write(self.keys, address, k_q)
            _write(self.values, address, v_q)
            _write(self.key_scales, address, k_scale)
            _write(self.value_scales, address, v_scale)
            return (
                _dequantize(_read(self.keys, address), _read(self.key_scales, address), self.dtype),
                _dequantize(
                    _read(self.values, address), _read(self.value_scales, address), self.dtype
                ),
            )
        _write(self.keys, address, k)
        _write(self.values, address, v)
        return _read(self.keys, address), _read(self.values, address)


class CacheAddress:
    """Where one forward pass reads and writes: per row a slot, per token a position."""

    __slots__ = (
        "kv_len",
        "positions",
        "single_slot",
        "single_slot_positions",
        "slot_window",
        "slots",
    )

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.slots = slots  # [B] int64
        self.positions = positions  # [B, T] int64
        # Keys beyond the furthest position written are never attended to.
        self.kv_len = int(positions.max()) + 1
        slot_list = slots.tolist()
        first, count = slot_list[0], len(slot_list)
        self.single_slot = first if count == 1 else None
        # The one row's positions, taken once here rather than at each of the writes.
        self.single_slot_positions = positions[0] if count == 1 else None
        # Rows that address slots first, first + 1, … in order can read the cache as a view.
        consecutive = slot_list == list(range(first, first + count))
        self.slot_window = slice(first, first + count) if consecutive else None


def kv_cache_bytes(model: nn.Module) -> int:
    """Bytes of every LayerKVCache buffer in ``model`` (K, V and any scales)."""
    return sum(
        buffer.numel() * buffer.element_size()
        for module in model.modules()
        if isinstance(module, LayerKVCache)
        for buffer in module.buffers()
    )


def _write(buffer: torch.Tensor, address: CacheAddress, x: torch.Tensor) -> None:
    """Store x [B, kv_heads, T, last] at the addressed slots and positions of buffer."""
    if address.single_slot is not None:
        buffer.narrow(0, address.single_slot, 1).index_copy_(2, address.single_slot_positions, x)
    else:
        buffer[address.slots[:, None], :, address.positions] = x.transpose(1, 2)


def _read(buffer: torch.Tensor, address: CacheAddress) -> torch.Tensor:
    """buffer's addressed slots up to kv_len: a view for consecutive slots, else a copy."""
    if address.slot_window is not None:
        return buffer[address.slot_window, :, : address.kv_len]
    return buffer[:, :, : address.kv_len].index_select(0, address.slots)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and bfloat16 scales [..., 1] with x ≈ values · scales per last-dim vector."""
    x = x.float()
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scales = (absmax / _INT8_MAX).clamp_min(torch.finfo(SCALE_DTYPE).tiny).to(SCALE_DTYPE)
    values = torch.round(x / scales.float()).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return values, scales


def _dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to(dtype) * scales.to(dtype)
