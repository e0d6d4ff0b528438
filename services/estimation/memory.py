"""Memory of any (tp, pp) from three reference layouts (the papers' M2, extended).

The papers split a deployment's footprint, summed over its devices, into weights ``W``,
activations ``A`` (replicated by tensor parallelism) and pipeline activations ``A_p``:

    mem(1,1) = W + A,   mem(2,1) = W + 2A,   mem(1,2) = W + A + A_p
    mem(tp, pp) = W + A + (tp - 1) * A + tp * (pp - 1) * A_p

iserve adds two terms, fitted per hardware type (:class:`MemoryConstants`):

    + tp_peer_gib * tp * pp * (tp - 1)      (runtime buffers per TP peer)
    + layout_residual_gib[(tp, pp)]          (what the layout costs beyond the model)

Every device keeps runtime buffers for each other rank of its tensor-parallel group
(communication workspaces, per-peer channels), so its fixed overhead grows with the group
size. The three references contain tp = 1 and tp = 2 only, so the papers' model
extrapolates a constant per-device overhead and underestimates tp = 8 badly (about 30 %
for Llama-2-7B on the A6000 data). A per-device overhead that does not depend on the
layout is already in the papers' model (it is part of A and A_p), so adding one would
change nothing. The references are still reproduced exactly: the solve subtracts the
term before splitting W, A and A_p.

What a layout costs beyond that is the runtime's (communication channels, stage
buffers), not the model's: on the A6000 data, mem(tp, pp) - mem(1,1) is the same for
every model and quantization to within about 0.3 GiB (8.2 GiB at (1,8), 22.7 GiB at
(8,1)), yet it does not follow the papers' shape (even pipeline degrees cost about
0.5 GiB more than odd ones, a stage in a tp = 4 group costs more than in a tp = 2 one).
So calibration also keeps, per layout, the median residual of the model above over the
calibration data (GiB, additive, zero where a layout was not calibrated). Both terms
are hardware constants; neither uses the model being estimated.

The KV cache is kept explicit: :func:`kv_cache_gib` sizes it from the architecture, the
maximum sequence length and the batch, so a deployment with a longer context or larger
batch than the profile's is charged for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.engine_rules import kv_heads_on_rank
from services.estimation.space import ModelShape

__all__ = [
    "GIB",
    "MemoryComponents",
    "MemoryConstants",
    "kv_cache_gib",
    "per_device_memory_gib",
    "solve_memory_components",
    "total_memory_gib",
]

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryConstants:
    """Hardware-level memory terms.

    ``tp_peer_gib``: GiB per device per other rank of its TP group.
    ``layout_residual_gib``: ((tp, pp), GiB) pairs added to the footprint of that layout.
    """

    tp_peer_gib: float = 0.0
    layout_residual_gib: tuple[tuple[tuple[int, int], float], ...] = ()

    def residual_gib(self, tp: np.ndarray, pp: np.ndarray) -> np.ndarray:
        """The calibrated residual of each (tp, pp), 0 for an uncalibrated layout (GiB)."""
        tp = np.asarray(tp)
        pp = np.asarray(pp)
        out = np.zeros(np.broadcast(tp, pp).shape)
        for (layout_tp, layout_pp), gib in self.layout_residual_gib:
            out = np.where((tp == layout_tp) & (pp == layout_pp), gib, out)
        return out


@dataclass(frozen=True)
class MemoryComponents:
    """W, A and A_p of one variant, GiB (arrays when solved for many variants at once)."""

    weights_gib: np.ndarray | float
    activations_gib: np.ndarray | float
    pipeline_activations_gib: np.ndarray | float


def _peer_term(tp: np.ndarray, pp: np.ndarray, constants: MemoryConstants) -> np.ndarray:
    return constants.tp_peer_gib * tp * pp * (tp - 1.0)


def solve_memory_components(
    m11: np.ndarray,
    m21: np.ndarray,
    m12: np.ndarray,
    constants: MemoryConstants = MemoryConstants(),
) -> MemoryComponents:
    """Solve W, A, A_p from the footprints (GiB) of the (1,1), (2,1), (1,2) references."""
    m11 = np.asarray(m11, dtype=float)
    one, two = np.ones_like(m11), 2.0 * np.ones_like(m11)

    # Take the hardware terms out of each reference before the papers' 3 x 3 solve.
    def extra(tp: np.ndarray, pp: np.ndarray) -> np.ndarray:
        return _peer_term(tp, pp, constants) + constants.residual_gib(tp, pp)

    r11 = m11 - extra(one, one)
    r21 = np.asarray(m21, dtype=float) - extra(two, one)
    r12 = np.asarray(m12, dtype=float) - extra(one, two)
    activations = r21 - r11
    return MemoryComponents(
        weights_gib=r11 - activations,
        activations_gib=activations,
        pipeline_activations_gib=r12 - r11,
    )


def total_memory_gib(
    components: MemoryComponents,
    tp: np.ndarray,
    pp: np.ndarray,
    constants: MemoryConstants = MemoryConstants(),
) -> np.ndarray:
    """Footprint summed over the tp * pp devices of a layout, GiB (broadcasts)."""
    tp = np.asarray(tp, dtype=float)
    pp = np.asarray(pp, dtype=float)
    c = components
    return (
        np.asarray(c.weights_gib)
        + tp * np.asarray(c.activations_gib)
        + tp * (pp - 1.0) * np.asarray(c.pipeline_activations_gib)
        + _peer_term(tp, pp, constants)
        + constants.residual_gib(tp, pp)
    )


def per_device_memory_gib(total_gib: np.ndarray, tp: np.ndarray, pp: np.ndarray) -> np.ndarray:
    """Mean footprint per device on a balanced layer split, GiB.

    The first and last pipeline stage also hold the embeddings and the LM head, so the
    largest device needs somewhat more; the deployer's layer mapping accounts for that.
    """
    return np.asarray(total_gib, dtype=float) / (np.asarray(tp) * np.asarray(pp))


def kv_replication(kv_heads: int, tp: np.ndarray | int) -> np.ndarray:
    """How many copies of the K and V heads ``tp`` tensor ranks hold together: 1 when tp
    divides the KV heads, more when it does not and each rank holds a whole head
    (``services.engine_rules.kv_heads_on_rank``: a multi-query model at tp = 8 stores
    its one KV head 8 times)."""
    tp = np.asarray(tp)
    per_rank = np.vectorize(lambda t: kv_heads_on_rank(kv_heads, int(t)), otypes=[float])
    return tp * per_rank(tp) / kv_heads


def kv_cache_gib(
    shape: ModelShape,
    max_seq_len: np.ndarray | int,
    batch: np.ndarray | int = 1,
    kv_quant: str = "fp16",
    tp: np.ndarray | int = 1,
) -> np.ndarray:
    """Static K and V cache for ``batch`` sequences of ``max_seq_len`` tokens, GiB.

    Summed over devices: tensor parallelism shards the KV heads and pipeline parallelism
    the layers, so the total depends on the layout only where ``tp`` ranks hold copies
    of heads it does not divide (:func:`kv_replication`).
    """
    tokens = np.asarray(max_seq_len, dtype=float) * np.asarray(batch, dtype=float)
    copies = kv_replication(shape.num_kv_heads, tp)
    return shape.kv_bytes_per_token(kv_quant) * tokens * copies / GIB
