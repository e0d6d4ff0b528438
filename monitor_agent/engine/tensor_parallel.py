"""Tensor parallelism as a load-time transform on the engine model (Megatron-style).

A rank of a tensor-parallel group of ``size`` holds:

* **attention**: a contiguous block of ``num_heads / size`` query heads. ``q_proj`` is
  column-parallel (the rows of those heads), ``o_proj`` row-parallel (the matching
  columns). KV heads are split the same way when ``size`` divides ``num_kv_heads``;
  otherwise (multi-query, or fewer KV heads than ranks, which needs ``num_kv_heads`` to
  divide ``size``) every rank holds the one KV head its query heads attend with, so KV
  heads are replicated ``size / num_kv_heads`` times. Either way query head ``i`` of a
  rank maps to local KV head ``i // (local q heads / local kv heads)``, exactly the
  grouping the unsharded model uses, so the attention code runs unchanged;
* **MLP**: a contiguous block of ``intermediate_size / size`` channels: ``gate_proj`` and
  ``up_proj`` column-parallel (rows), ``down_proj`` row-parallel (columns);
* **the rest** replicated: norms, the token embedding and the LM head (simple and exact;
  every rank computes the same logits and the driver samples from its own copy).

The row-parallel outputs are partial sums; ``attention.reduce`` and ``mlp.reduce`` are
set to the group's all-reduce, and a row-parallel bias is kept on tensor rank 0 only
(the other ranks' ``o_proj``/``down_proj`` have no bias), so it is added once.

:func:`shard_modules` narrows the modules of a model built on the meta device and
:func:`shard_sources` narrows ``ArchSpec.stage_weights`` to the same slices, so the
loader reads only this rank's rows and columns of every sharded tensor (Falcon's fused
``query_key_value`` included: its per-group q, k and v row ranges are narrowed in the
order of the heads they hold).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from services.engine_rules import (
    TENSOR_PARALLEL_DEGREES,
    kv_heads_on_rank,
    tensor_parallel_problem,
)
from services.models.arch import ArchSpec, RowRanges, WeightSource

__all__ = [
    "HeadSlice",
    "TensorShard",
    "check_tensor_parallel",
    "head_slice",
    "shard_modules",
    "shard_sources",
]

# "layers.{j}.{module path}.{weight|bias}" of the sharded Linears.
_LAYER_PARAMETER = re.compile(r"layers\.\d+\.(?P<module>[a-z_.]+)\.(?P<kind>weight|bias)")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of a tensor-parallel group of ``size``; ``all_reduce`` sums a tensor
    over the group (in place or not) and returns the sum."""

    size: int
    rank: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = _identity

    def __post_init__(self) -> None:
        if self.size not in TENSOR_PARALLEL_DEGREES:
            raise ValueError(
                f"tensor parallel size must be one of {TENSOR_PARALLEL_DEGREES}, got {self.size}"
            )
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor rank must be in [0, {self.size}), got {self.rank}")


@dataclass(frozen=True)
class HeadSlice:
    """The global heads one rank holds: query heads [q_start, q_stop), KV heads
    [kv_start, kv_stop), and MLP channels [inner_start, inner_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    inner_start: int
    inner_stop: int


def check_tensor_parallel(spec: ArchSpec, size: int) -> None:
    """ValueError, naming the model's numbers, when ``spec`` cannot be split ``size`` ways."""
    problem = tensor_parallel_problem(
        size, heads=spec.num_heads, kv_heads=spec.num_kv_heads, mlp_width=spec.intermediate_size
    )
    if problem:
        raise ValueError(problem)


def head_slice(spec: ArchSpec, size: int, rank: int) -> HeadSlice:
    """The heads and MLP channels of tensor rank ``rank`` of ``size`` (see module docstring)."""
    check_tensor_parallel(spec, size)
    q_per_rank = spec.num_heads // size
    q_start = rank * q_per_rank
    kv_per_rank = kv_heads_on_rank(spec.num_kv_heads, size)
    if spec.num_kv_heads % size == 0:
        kv_start = rank * kv_per_rank
    else:
        # Fewer KV heads than ranks: the one KV head this rank's query heads belong to.
        kv_start = q_start // (spec.num_heads // spec.num_kv_heads)
    inner_per_rank = spec.intermediate_size // size
    return HeadSlice(
        q_start,
        q_start + q_per_rank,
        kv_start,
        kv_start + kv_per_rank,
        rank * inner_per_rank,
        (rank + 1) * inner_per_rank,
    )


def _layouts(spec: ArchSpec, heads: HeadSlice) -> dict[str, tuple[str, int, int]]:
    """Per sharded module: ("rows" | "columns", start, stop) of its global weight."""
    d = spec.head_dim
    q = (heads.q_start * d, heads.q_stop * d)
    kv = (heads.kv_start * d, heads.kv_stop * d)
    inner = (heads.inner_start, heads.inner_stop)
    return {
        "self_attn.q_proj": ("rows", *q),
        "self_attn.k_proj": ("rows", *kv),
        "self_attn.v_proj": ("rows", *kv),
        "self_attn.o_proj": ("columns", *q),
        "mlp.gate_proj": ("rows", *inner),
        "mlp.up_proj": ("rows", *inner),
        "mlp.down_proj": ("columns", *inner),
    }


def shard_modules(model: nn.Module, shard: TensorShard) -> None:
    """Narrow every layer of ``model`` (a Transformer, best still on the meta device) to
    ``shard``'s heads and channels and route its attention and MLP outputs through
    ``shard.all_reduce``. Parameters of narrowed Linears are new and uninitialised: load
    them with :func:`shard_sources`. Call ``setup_caches`` afterwards."""
    spec: ArchSpec = model.spec
    heads = head_slice(spec, shard.size, shard.rank)
    layouts = _layouts(spec, heads)
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for path, (kind, start, stop) in layouts.items():
            owner_name, name = path.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, name)
            if linear is None:  # gate_proj of a plain MLP
                continue
            keep_bias = linear.bias is not None and (kind == "rows" or shard.rank == 0)
            setattr(owner, name, _narrowed(linear, kind, stop - start, keep_bias))
        attention.n_heads = heads.q_stop - heads.q_start
        attention.n_kv_heads = heads.kv_stop - heads.kv_start
        if shard.size > 1:
            attention.reduce = shard.all_reduce
            mlp.reduce = shard.all_reduce


def _narrowed(linear: nn.Linear, kind: str, width: int, bias: bool) -> nn.Linear:
    weight = linear.weight
    in_features, out_features = linear.in_features, linear.out_features
    if kind == "rows":
        out_features = width
    else:
        in_features = width
    return nn.Linear(in_features, out_features, bias=bias, dtype=weight.dtype, device=weight.device)


def shard_sources(
    spec: ArchSpec, sources: dict[str, WeightSource], shard: TensorShard
) -> dict[str, WeightSource]:
    """``sources`` (``ArchSpec.stage_weights``) narrowed to ``shard``: rows of
    column-parallel weights and biases, columns of row-parallel weights; row-parallel
    biases only on tensor rank 0; everything else unchanged (replicated)."""
    layouts = _layouts(spec, head_slice(spec, shard.size, shard.rank))
    out: dict[str, WeightSource] = {}
    for name, source in sources.items():
        match = _LAYER_PARAMETER.fullmatch(name)
        layout = layouts.get(match["module"]) if match else None
        if layout is None:
            out[name] = source
            continue
        kind, start, stop = layout
        if kind == "rows":
            out[name] = dataclasses.replace(source, rows=narrow_rows(source.rows, start, stop))
        elif match["kind"] == "weight":
            out[name] = dataclasses.replace(source, columns=(start, stop))
        elif shard.rank == 0:
            out[name] = source
    return out


def narrow_rows(rows: RowRanges | None, start: int, stop: int) -> RowRanges:
    """Rows [start, stop) of the tensor that ``rows`` describe (None: the whole tensor),
    as ranges of the underlying checkpoint tensor, adjacent ranges merged."""
    if rows is None:
        return ((start, stop),)
    out: list[tuple[int, int]] = []
    offset = 0  # position of the current range in the concatenated tensor
    for first, last in rows:
        length = last - first
        lo, hi = max(start, offset), min(stop, offset + length)
        if lo < hi:
            piece = (first + lo - offset, first + hi - offset)
            if out and out[-1][1] == piece[0]:
                out[-1] = (out[-1][0], piece[1])
            else:
                out.append(piece)
        offset += length
    if sum(b - a for a, b in out) != stop - start:
        raise ValueError(f"rows [{start}, {stop}) are outside the ranges {rows}")
    return tuple(out)
