"""The engine's compression options by name, and what structured pruning keeps.

Shared by the engine (``monitor_agent.engine.compression``), the worker's command line,
the agent that builds it and the deployer's memory model, none of which may import each
other (and the last three must not import torch).
"""

from __future__ import annotations

import math

WEIGHT_QUANTIZATIONS = ("none", "int8", "int4")
KV_QUANTIZATIONS = ("none", "int8")
# "2:4" keeps the pruned weights dense with zeros; "2:4-compact" stores values + indices.
PRUNINGS = ("none", "2:4", "2:4-compact", "structured")
# The share of heads and MLP channels structured pruning drops unless told otherwise.
DEFAULT_PRUNE_FRACTION = 0.25
DEFAULT_INT4_GROUP_SIZE = 128
# Structured pruning keeps an MLP width that is a multiple of 16 a multiple of 16 (the
# int8 and int4 CPU kernels need it).
MLP_CHANNEL_MULTIPLE = 16


def kept_heads(heads: int, kv_heads: int, fraction: float) -> tuple[int, int]:
    """(query heads, KV heads) structured pruning of ``fraction`` keeps of an attention
    with ``heads`` query heads in ``kv_heads`` groups.

    With one query head per KV head, ``floor(fraction · heads)`` whole heads go (query, key
    and value); with grouped or multi-query attention each group loses
    ``floor(fraction · group)`` query heads and every KV head stays.
    """
    _check_fraction(fraction)
    group = heads // kv_heads
    if group == 1:
        kept = heads - math.floor(fraction * heads)
        return kept, kept
    return kv_heads * (group - math.floor(fraction * group)), kv_heads


def kept_mlp_channels(channels: int, fraction: float) -> int:
    """The MLP width structured pruning of ``fraction`` keeps: ``floor(fraction ·
    channels)`` go, rounded down to a multiple of 16 when ``channels`` is one."""
    _check_fraction(fraction)
    dropped = math.floor(fraction * channels)
    if channels % MLP_CHANNEL_MULTIPLE == 0:
        dropped -= dropped % MLP_CHANNEL_MULTIPLE
    return channels - dropped


def _check_fraction(fraction: float) -> None:
    if not 0 <= fraction < 1:
        raise ValueError(f"prune fraction must be in [0, 1), got {fraction}")
