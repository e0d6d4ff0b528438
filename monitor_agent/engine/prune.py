"""Magnitude pruning of a decoder layer's projections: 2:4 semi-structured and structured.

**2:4 semi-structured.** In every group of 4 consecutive input weights of a row the 2
largest |w| stay and the other 2 become 0. :func:`prune_2_4_` keeps the weight dense with
zeros: same bytes, same speed on CPU, where no kernel skips the zeros (on CUDA,
``torch.sparse.to_sparse_semi_structured`` could). :class:`Sparse24Linear` stores it
compactly: the kept values [out, in/2] in the weight's dtype and their positions as
2-bit indices, 4 bits per group, two groups per byte (uint8 [out, in/8]); 0.53 of the
dense float32 bytes, 0.56 of bfloat16. Without a sparse kernel its forward rebuilds the
dense weight every call, which is many times slower than a dense matmul.

**Structured.** A fraction of the attention heads and MLP channels is removed, so the
tensors really shrink:

* attention, scored by the squared L2 norm of each query head's q_proj rows and o_proj
  columns (plus, for a KV head, its k_proj and v_proj rows). With one query head per KV
  head (multi-head attention) whole heads go, q/k/v/o together. With grouped or
  multi-query attention every KV group keeps the same number of its best query heads and
  all KV heads stay, so the grouping ``query head i -> KV head i // group`` stays valid;
* MLP, scored per inner channel by ‖gate row‖·‖up row‖ (‖up row‖ without a gate) times
  ‖down column‖; the channels are dropped from gate/up rows and down columns.

How many go is :func:`services.models.compression.kept_heads` /
``kept_mlp_channels``: ``floor(fraction × count)`` heads (or query heads per group); for
the MLP that many channels rounded down to a multiple of 16, so an inner width that was a
multiple of 16 stays one (what the int8 and int4 kernels need). The attention's ``n_heads`` and
``n_kv_heads`` are updated, so ``setup_caches`` sizes the KV cache for the heads left.
Scores are local to the module pruned: under tensor parallelism each rank prunes its own
shard's heads and channels (valid, since the dropped terms are local to the rank's
partial sum), which differs from pruning the whole model by global scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from monitor_agent.engine.layers import MLP, Attention
from services.engine_rules import SPARSE_2_4_GROUP
from services.models.compression import kept_heads, kept_mlp_channels

__all__ = [
    "Sparse24Linear",
    "prune_2_4_",
    "prune_heads_",
    "prune_mlp_channels_",
    "semi_structured_mask",
]

_GROUP = SPARSE_2_4_GROUP  # what services.engine_rules checks before a launch
_KEPT = 2
# Rows pruned at a time: bounds the temporaries next to the layer being loaded.
_CHUNK_ROWS = 256


def _nibble_table() -> torch.Tensor:
    """For each 4-bit pattern with bits i0 < i1 set, the nibble i0 | i1 << 2."""
    table = torch.zeros(16, dtype=torch.uint8)
    for first in range(_GROUP):
        for second in range(first + 1, _GROUP):
            table[(1 << first) | (1 << second)] = first | (second << 2)
    return table


_NIBBLE_OF_PATTERN = _nibble_table()


def semi_structured_mask(weight: torch.Tensor) -> torch.Tensor:
    """Boolean mask of ``weight`` [out, in] keeping the 2 largest |w| of every 4
    consecutive inputs of each row (of equal ones, the first); ValueError unless in is a
    multiple of 4."""
    _check_groups(weight, _GROUP)
    mask = torch.empty(weight.shape, dtype=torch.bool, device=weight.device)
    for start in range(0, weight.shape[0], _CHUNK_ROWS):
        mask[start : start + _CHUNK_ROWS] = _keep_two_of_four(weight[start : start + _CHUNK_ROWS])
    return mask


@torch.no_grad()
def prune_2_4_(linear: nn.Linear) -> None:
    """Zero the 2 smallest |w| of every 4 consecutive inputs of each row, in place."""
    weight = linear.weight
    _check_groups(weight, _GROUP)
    for start in range(0, weight.shape[0], _CHUNK_ROWS):
        rows = weight[start : start + _CHUNK_ROWS]
        rows.masked_fill_(~_keep_two_of_four(rows), 0)


def _check_groups(weight: torch.Tensor, multiple: int) -> None:
    if weight.shape[1] % multiple:
        raise ValueError(
            f"2:4 pruning needs in_features divisible by {multiple}, got {weight.shape[1]}"
        )


def _keep_two_of_four(weight: torch.Tensor) -> torch.Tensor:
    """The 2:4 mask of ``weight`` [rows, in], by a round robin in each group of 4: an entry
    beats another with a smaller |w|, or an equal one later in the group, and the two that
    win at least 2 of their 3 matches stay. The order is total, so exactly two do; six
    comparisons of the group's columns are ~2.5x faster than ``topk`` along a dim of 4."""
    rows, in_features = weight.shape
    columns = weight.detach().abs().view(rows, -1, _GROUP).unbind(-1)
    wins = [columns[0].new_zeros(columns[0].shape, dtype=torch.uint8) for _ in range(_GROUP)]
    for i in range(_GROUP):
        for j in range(i + 1, _GROUP):
            i_beats_j = columns[i] >= columns[j]
            wins[i] += i_beats_j
            wins[j] += ~i_beats_j
    return torch.stack([count >= _KEPT for count in wins], dim=-1).view(rows, in_features)


class Sparse24Linear(nn.Module):
    """A 2:4-pruned Linear stored as kept values plus 2-bit positions (see module doc)."""

    def __init__(
        self, values: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features = values.shape[0]
        self.in_features = values.shape[1] * 2
        self.register_buffer("values", values)
        self.register_buffer("positions", positions)
        self.register_buffer("bias", bias)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Sparse24Linear:
        """2:4-prune ``linear`` by magnitude and store it compactly; in_features must be a
        multiple of 8 (two groups per position byte)."""
        weight = linear.weight.detach()
        _check_groups(weight, 2 * _GROUP)
        out_features, in_features = weight.shape
        values = weight.new_empty(out_features, in_features // 2)
        positions = torch.empty(
            out_features, in_features // 8, dtype=torch.uint8, device=weight.device
        )
        nibble_of_pattern = _NIBBLE_OF_PATTERN.to(weight.device)
        bits = torch.tensor([1, 2, 4, 8], dtype=torch.uint8, device=weight.device)
        for start in range(0, out_features, _CHUNK_ROWS):
            rows = weight[start : start + _CHUNK_ROWS]
            mask = _keep_two_of_four(rows)
            # Boolean indexing keeps row-major order: each group's 2 values, in place order.
            values[start : start + _CHUNK_ROWS] = rows[mask].view(rows.shape[0], -1)
            pattern = (mask.view(rows.shape[0], -1, _GROUP).to(torch.uint8) * bits).sum(
                -1, dtype=torch.uint8
            )
            nibbles = nibble_of_pattern[pattern.long()].view(rows.shape[0], -1, 2)
            positions[start : start + _CHUNK_ROWS] = nibbles[..., 0] | (nibbles[..., 1] << 4)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(values, positions, bias)

    def to_dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense [out, in] weight, zeros included, in ``dtype`` (default: stored)."""
        rows = self.out_features
        nibbles = torch.stack((self.positions & 0xF, self.positions >> 4), dim=-1).view(rows, -1)
        kept = torch.stack((nibbles & 0x3, nibbles >> 2), dim=-1).long()  # [out, G, 2]
        values = self.values.view(rows, -1, _KEPT)
        if dtype is not None:
            values = values.to(dtype)
        dense = values.new_zeros(rows, values.shape[1], _GROUP).scatter_(-1, kept, values)
        return dense.view(rows, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.to_dense(x.dtype))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _rows(linear: nn.Linear, index: torch.Tensor) -> nn.Linear:
    """A Linear holding only the output rows ``index`` of ``linear``."""
    bias = None if linear.bias is None else linear.bias[index]
    return _linear(linear.weight[index], bias, linear.weight.requires_grad)


def _columns(linear: nn.Linear, index: torch.Tensor) -> nn.Linear:
    """A Linear holding only the input columns ``index`` of ``linear`` (bias unchanged)."""
    return _linear(linear.weight[:, index], linear.bias, linear.weight.requires_grad)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool) -> nn.Linear:
    out_features, in_features = weight.shape
    # Built on the meta device: no memory spent on an initialisation that is overwritten.
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=requires_grad)
    return linear


def _row_norms(weight: torch.Tensor, rows_per_unit: int) -> torch.Tensor:
    """Squared L2 norm of each block of ``rows_per_unit`` rows of weight [rows, in]."""
    return weight.detach().float().pow(2).reshape(-1, rows_per_unit * weight.shape[1]).sum(-1)


def _units(index: torch.Tensor, size: int) -> torch.Tensor:
    """Row indices of units ``index`` (sorted) of ``size`` rows each."""
    return (index[:, None] * size + torch.arange(size, device=index.device)).flatten()


@torch.no_grad()
def prune_heads_(attention: Attention, fraction: float) -> None:
    """Drop ``floor(fraction × count)`` heads of ``attention`` by norm, in place (see the
    module docstring for how KV groups are kept valid)."""
    heads, kv_heads, dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    group = heads // kv_heads
    q_scores = _row_norms(attention.q_proj.weight, dim) + _row_norms(
        attention.o_proj.weight.t(), dim
    )
    keep, _ = kept_heads(heads, kv_heads, fraction)
    if group == 1:
        scores = q_scores + _row_norms(attention.k_proj.weight, dim)
        scores += _row_norms(attention.v_proj.weight, dim)
        kv_keep = q_keep = scores.topk(keep).indices.sort().values
    else:
        per_group = keep // kv_heads
        best = q_scores.view(kv_heads, group).topk(per_group, dim=-1).indices.sort(dim=-1).values
        q_keep = (best + torch.arange(kv_heads, device=best.device)[:, None] * group).flatten()
        kv_keep = torch.arange(kv_heads, device=best.device)
    if q_keep.numel() == heads and kv_keep.numel() == kv_heads:
        return
    q_rows, kv_rows = _units(q_keep, dim), _units(kv_keep, dim)
    attention.q_proj = _rows(attention.q_proj, q_rows)
    attention.k_proj = _rows(attention.k_proj, kv_rows)
    attention.v_proj = _rows(attention.v_proj, kv_rows)
    attention.o_proj = _columns(attention.o_proj, q_rows)
    attention.n_heads, attention.n_kv_heads = q_keep.numel(), kv_keep.numel()


@torch.no_grad()
def prune_mlp_channels_(mlp: MLP, fraction: float) -> None:
    """Drop the weakest inner channels of ``mlp`` (see the module docstring), in place."""
    inner = mlp.up_proj.weight.shape[0]
    keep_count = kept_mlp_channels(inner, fraction)
    if keep_count == inner:
        return
    scores = mlp.up_proj.weight.detach().float().norm(dim=1)
    if mlp.gate_proj is not None:
        scores = scores * mlp.gate_proj.weight.detach().float().norm(dim=1)
    scores = scores * mlp.down_proj.weight.detach().float().norm(dim=0)
    keep = scores.topk(keep_count).indices.sort().values
    if mlp.gate_proj is not None:
        mlp.gate_proj = _rows(mlp.gate_proj, keep)
    mlp.up_proj = _rows(mlp.up_proj, keep)
    mlp.down_proj = _columns(mlp.down_proj, keep)
