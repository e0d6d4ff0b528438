"""A static KV cache: one K and one V buffer per layer, allocated once.

Each buffer is [max_batch, kv_heads, max_seq_len, head_dim]. A sequence owns one slot
(the first index) for its lifetime and writes the keys of position p at [slot, :, p].
Nothing is allocated per step; reads return views when a single slot is addressed.
"""

from __future__ import annotations

import torch
from torch import nn


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
        shape = (max_batch, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer(
            "keys", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "values", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )

    def update(
        self, address: CacheAddress, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, head_dim]; return every cached key and value of the
        addressed slots up to address.kv_len, as [B, kv_heads, kv_len, head_dim]."""
        if address.single_slot is not None:
            slot = address.single_slot
            self.keys[slot].index_copy_(1, address.positions[0], k[0])
            self.values[slot].index_copy_(1, address.positions[0], v[0])
            window = slice(slot, slot + 1)
            return (
                self.keys[window, :, : address.kv_len],
                self.values[window, :, : address.kv_len],
            )
        rows, cols = address.slots[:, None], address.positions
        self.keys[rows, :, cols] = k.transpose(1, 2)
        self.values[rows, :, cols] = v.transpose(1, 2)
        return (
            self.keys[:, :, : address.kv_len].index_select(0, address.slots),
            self.values[:, :, : address.kv_len].index_select(0, address.slots),
        )


class CacheAddress:
    """Where one forward pass reads and writes: per row a slot, per token a position."""

    __slots__ = ("kv_len", "positions", "single_slot", "slots")

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.slots = slots  # [B] int64
        self.positions = positions  # [B, T] int64
        # Keys beyond the furthest position written are never attended to.
        self.kv_len = int(positions.max()) + 1
        self.single_slot = int(slots[0]) if slots.shape[0] == 1 else None
