"""Compression as a transform on decoder layers: pruning, then weight-only quantization.

:func:`apply_compression` takes anything that holds decoder layers (a whole model, a
pipeline stage, a tensor-parallel shard, or a single ``DecoderLayer``) and changes their
attention and MLP projections in place; embeddings, norms and the LM head keep the model
dtype. The loader calls it on each layer as soon as that layer is read
(``load_model(on_layer_loaded=...)``), after tensor-parallel sharding, so a rank
quantizes its own shard and the full-precision model is never resident at once.

Order within a layer: structured pruning (shapes shrink), 2:4 pruning (zeros), then
int8/int4 quantization of what is left. KV-cache int8 is not a weight transform: the
engine applies it when it allocates the cache (``kv_cache_quantization``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from monitor_agent.engine.layers import DecoderLayer
from monitor_agent.engine.prune import (
    Sparse24Linear,
    prune_2_4_,
    prune_heads_,
    prune_mlp_channels_,
)
from monitor_agent.engine.quantize import quantize_linears
from services.models.compression import (
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_PRUNE_FRACTION,
    PRUNINGS,
    WEIGHT_QUANTIZATIONS,
)

__all__ = [
    "DEFAULT_PRUNE_FRACTION",
    "PRUNINGS",
    "WEIGHT_QUANTIZATIONS",
    "CompressionSpec",
    "apply_compression",
]


@dataclass(frozen=True)
class CompressionSpec:
    """What to do to every decoder layer's projections.

    ``prune_fraction`` (in [0, 1)) is the share of heads and MLP channels structured
    pruning drops; ``int4_group_size`` the input weights sharing one int4 scale.
    """

    weight_quant: str = "none"
    pruning: str = "none"
    prune_fraction: float = DEFAULT_PRUNE_FRACTION
    int4_group_size: int = DEFAULT_INT4_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.weight_quant not in WEIGHT_QUANTIZATIONS:
            raise ValueError(
                f"weight_quant must be one of {WEIGHT_QUANTIZATIONS}, got {self.weight_quant!r}"
            )
        if self.pruning not in PRUNINGS:
            raise ValueError(f"pruning must be one of {PRUNINGS}, got {self.pruning!r}")
        if not 0 <= self.prune_fraction < 1:
            raise ValueError(f"prune_fraction must be in [0, 1), got {self.prune_fraction}")
        if self.pruning == "2:4-compact" and self.weight_quant != "none":
            raise ValueError(
                "2:4-compact keeps its values in the model dtype; combine 2:4 (dense) "
                f"with {self.weight_quant} instead"
            )

    @property
    def is_identity(self) -> bool:
        return self.weight_quant == "none" and self.pruning == "none"


def apply_compression(module: nn.Module, spec: CompressionSpec) -> None:
    """Compress every decoder layer in ``module`` (or ``module`` itself, if it is one) as
    ``spec`` says, in place. Call ``setup_caches`` afterwards: structured pruning changes
    the attention's KV heads."""
    layers = (
        [module]
        if isinstance(module, DecoderLayer)
        else [m for m in module.modules() if isinstance(m, DecoderLayer)]
    )
    for layer in layers:
        _compress_layer(layer, spec)


def _compress_layer(layer: DecoderLayer, spec: CompressionSpec) -> None:
    if spec.pruning == "structured":
        prune_heads_(layer.self_attn, spec.prune_fraction)
        prune_mlp_channels_(layer.mlp, spec.prune_fraction)
    elif spec.pruning in ("2:4", "2:4-compact"):
        for parent, name, linear in _projections(layer):
            if spec.pruning == "2:4":
                prune_2_4_(linear)
            else:
                setattr(parent, name, Sparse24Linear.from_linear(linear))
    if spec.weight_quant != "none":
        for block in (layer.self_attn, layer.mlp):
            quantize_linears(block, spec.weight_quant, int4_group=spec.int4_group_size)


def _projections(layer: DecoderLayer) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, Linear) of each attention and MLP projection of ``layer``."""
    return [
        (block, name, child)
        for block in (layer.self_attn, layer.mlp)
        for name, child in block.named_children()
        if isinstance(child, nn.Linear)
    ]
