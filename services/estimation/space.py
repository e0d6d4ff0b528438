"""The configuration space: every (tp, pp, variant, batch) a model may be deployed with.

A configuration is a tensor-parallel degree ``tp``, a pipeline-parallel degree ``pp``, a
*variant* (weight quantization, KV-cache quantization, pruning; a separately registered
checkpoint is a variant of its own) and a batch size. The space is held as one numpy
structured array so that scoring every configuration is array arithmetic, not a loop.

Constraints (DESIGN.md, "Configuration space"): what the engine can run, as
``services.engine_rules`` says (tp in {1, 2, 4, 8} dividing the heads and the MLP width,
and dividing the KV heads or a multiple of them; pp from 1 to 8 and at most the number of
layers), and tp * pp at most the devices available. On 8 devices that leaves 15 (tp, pp)
pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from services.engine_rules import (
    MAX_PIPELINE_PARALLEL,
    TENSOR_PARALLEL_DEGREES,
    compression_problem,
    parallel_problem,
    served_prune_fractions,
)

__all__ = [
    "CONFIG_DTYPE",
    "KV_QUANTS",
    "WEIGHT_QUANTS",
    "ConfigSpace",
    "ModelShape",
    "Variant",
    "enumerate_space",
    "parallel_pairs",
    "standard_variants",
]

# Weight quantizations: 16-bit, int8 / int4 weight-only, pre-quantized int4 (GPTQ/AWQ).
WEIGHT_QUANTS: tuple[str, ...] = ("fp16", "int8", "int4", "int4_gptq")
KV_QUANTS: tuple[str, ...] = ("fp16", "int8")
# Bytes per stored element of each KV-cache quantization.
KV_BYTES: dict[str, float] = {"fp16": 2.0, "int8": 1.0}

CONFIG_DTYPE = np.dtype(
    [("tp", np.int32), ("pp", np.int32), ("variant", np.int32), ("batch", np.int32)]
)


@dataclass(frozen=True)
class ModelShape:
    """What the estimator needs to know of a model's architecture.

    The heads and the MLP width bound tensor parallelism; ``num_kv_heads`` and
    ``head_dim`` size the KV cache; ``max_positions`` (the model's context) bounds
    prompt plus output tokens; ``layer_weights`` (the weights of one decoder layer, as
    the checkpoint's tensors count them, whatever the MLP's form) gives prefill's
    attention share; the widths (``hidden_size``, heads, MLP) bound the compressions a
    tensor rank can apply. Values come from the checkpoint's config; ``mlp_width``,
    ``max_positions``, ``layer_weights`` and ``hidden_size`` 0 mean unknown (a shape
    imported from measurements alone; the hidden size is then taken as the heads').
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_width: int = 0
    max_positions: int = 0
    layer_weights: int = 0
    hidden_size: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if value <= 0:
                raise ValueError(f"{self.name}: {field} must be positive, got {value}")
        for field in ("mlp_width", "max_positions", "layer_weights", "hidden_size"):
            value = getattr(self, field)
            if value < 0:
                raise ValueError(f"{self.name}: {field} must not be negative, got {value}")

    def kv_bytes_per_token(self, kv_quant: str = "fp16") -> float:
        """Bytes of K and V one token occupies across all layers (unsharded)."""
        if kv_quant not in KV_BYTES:
            raise ValueError(f"unknown KV quantization {kv_quant!r}; known: {sorted(KV_BYTES)}")
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * KV_BYTES[kv_quant]


@dataclass(frozen=True)
class Variant:
    """One compressed form of a model; ``accuracy_pct`` is % of the FP16 score (e.g. MMLU)."""

    name: str
    weight_quant: str = "fp16"
    kv_quant: str = "fp16"
    pruning: str | None = None
    accuracy_pct: float | None = None

    def __post_init__(self) -> None:
        if self.weight_quant not in WEIGHT_QUANTS:
            raise ValueError(
                f"variant {self.name!r}: unknown weight quantization {self.weight_quant!r}; "
                f"known: {list(WEIGHT_QUANTS)}"
            )
        if self.kv_quant not in KV_QUANTS:
            raise ValueError(
                f"variant {self.name!r}: unknown KV-cache quantization {self.kv_quant!r}; "
                f"known: {list(KV_QUANTS)}"
            )


def standard_variants(
    weight_quants: Sequence[str] = WEIGHT_QUANTS,
    kv_quants: Sequence[str] = KV_QUANTS,
    prunings: Sequence[str] = (),
) -> tuple[Variant, ...]:
    """Every weight x KV quantization, then one 16-bit variant per pruning method.

    With the defaults and four pruning methods this is the papers' 12 variants per
    parallel layout (4 x 2 + 4).
    """
    quantized = [
        Variant(f"{w}/kv-{kv}", weight_quant=w, kv_quant=kv)
        for w in weight_quants
        for kv in kv_quants
    ]
    pruned = [Variant(f"pruned-{p}", pruning=p) for p in prunings]
    return tuple(quantized + pruned)


def parallel_pairs(shape: ModelShape, devices: int) -> tuple[tuple[int, int], ...]:
    """Every (tp, pp) the engine can run on at most ``devices`` devices, ordered by tp
    then pp."""
    if devices <= 0:
        raise ValueError(f"devices must be positive, got {devices}")
    return tuple(
        (tp, pp)
        for tp in TENSOR_PARALLEL_DEGREES
        for pp in range(1, MAX_PIPELINE_PARALLEL + 1)
        if tp * pp <= devices
        and not parallel_problem(
            tp,
            pp,
            heads=shape.num_heads,
            kv_heads=shape.num_kv_heads,
            mlp_width=shape.mlp_width,
            num_layers=shape.num_layers,
        )
    )


def compression_problem_of(shape: ModelShape, variant: Variant, tp: int) -> str | None:
    """Why the engine cannot apply ``variant``'s load-time compressions (int4 weights,
    2:4 or structured pruning) to a model shaped ``shape`` on each of ``tp`` tensor
    ranks, or None (``engine_rules.compression_problem``)."""
    return compression_problem(
        tp,
        hidden=shape.hidden_size or shape.num_heads * shape.head_dim,
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        mlp_width=shape.mlp_width,
        int4=variant.weight_quant == "int4",
        sparse_2_4=variant.pruning == "2:4",
        prune_fractions=served_prune_fractions(variant.pruning == "structured"),
    )


@dataclass(frozen=True)
class ConfigSpace:
    """Every configuration of one model as a read-only structured array (``CONFIG_DTYPE``).

    ``configs["variant"]`` indexes ``variants``. Row order: variant, then (tp, pp), then
    batch, so a slice of one variant is contiguous.
    """

    shape: ModelShape
    devices: int
    variants: tuple[Variant, ...]
    configs: np.ndarray

    @property
    def size(self) -> int:
        """Number of configurations."""
        return int(self.configs.shape[0])

    @property
    def tp(self) -> np.ndarray:
        return self.configs["tp"]

    @property
    def pp(self) -> np.ndarray:
        return self.configs["pp"]

    @property
    def variant(self) -> np.ndarray:
        return self.configs["variant"]

    @property
    def batch(self) -> np.ndarray:
        return self.configs["batch"]

    @property
    def device_count(self) -> np.ndarray:
        """Devices each configuration occupies (tp * pp)."""
        return self.configs["tp"] * self.configs["pp"]

    def describe(self, index: int) -> str:
        """One configuration in words, e.g. ``tp=2 pp=4 int4/kv-fp16 batch=8``."""
        row = self.configs[index]
        return f"tp={row['tp']} pp={row['pp']} {self.variants[row['variant']].name} batch={row['batch']}"


def enumerate_space(
    shape: ModelShape,
    devices: int,
    variants: Sequence[Variant],
    batch_sizes: Iterable[int] = (1,),
) -> ConfigSpace:
    """Build the space of ``shape`` on ``devices`` devices for the given variants and batches."""
    variants = tuple(variants)
    batches = np.asarray(sorted(set(batch_sizes)), dtype=np.int32)
    if not variants:
        raise ValueError("at least one variant is needed")
    if batches.size == 0 or batches[0] < 1:
        raise ValueError(f"batch sizes must be positive, got {batches.tolist()}")
    pairs = np.asarray(parallel_pairs(shape, devices), dtype=np.int32).reshape(-1, 2)
    n_var, n_pair, n_batch = len(variants), pairs.shape[0], batches.size
    configs = np.empty(n_var * n_pair * n_batch, dtype=CONFIG_DTYPE)
    configs["variant"] = np.repeat(np.arange(n_var, dtype=np.int32), n_pair * n_batch)
    configs["tp"] = np.tile(np.repeat(pairs[:, 0], n_batch), n_var)
    configs["pp"] = np.tile(np.repeat(pairs[:, 1], n_batch), n_var)
    configs["batch"] = np.tile(batches, n_var * n_pair)
    # A variant's int4 or 2:4 groups may not divide a tensor rank's share of the widths:
    # the engine cannot run it there, so it is neither estimated nor ranked.
    keep = np.ones(configs.size, dtype=bool)
    for v, variant in enumerate(variants):
        for tp in sorted({int(t) for t in pairs[:, 0]}):
            if compression_problem_of(shape, variant, tp):
                keep &= (configs["variant"] != v) | (configs["tp"] != tp)
    configs = configs[keep]
    configs.flags.writeable = False
    return ConfigSpace(shape=shape, devices=devices, variants=variants, configs=configs)
