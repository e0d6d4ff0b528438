"""How much device memory a deployment needs per rank, from the model's shape alone.

Used for explicit configurations (and as the floor under estimates): weights split over
tp·pp ranks, the KV cache for every slot at the maximum sequence length on each rank's
layers and heads, and a fixed runtime overhead per worker process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb

MIB = 1 << 20
# Resident memory of an idle PyTorch worker process (interpreter, torch, gRPC), measured
# at about 330 MiB on CPU; rounded up so reservations cover it.
RUNTIME_OVERHEAD_BYTES = 512 * MIB
DTYPE_BYTES = {
    common.PRECISION_FLOAT32: 4,
    common.PRECISION_FLOAT16: 2,
    common.PRECISION_BFLOAT16: 2,
}


@dataclass(frozen=True)
class RankMemory:
    weights_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes


def rank_memory(
    shape: model_pb.ModelShape,
    config: common.DeploymentConfig,
    max_seq_len: int,
    stage_layers: int,
) -> RankMemory:
    """Memory of one rank that holds ``stage_layers`` decoder layers."""
    tp = max(1, config.tensor_parallel)
    stored = DTYPE_BYTES.get(shape.dtype, 4)
    served = DTYPE_BYTES.get(config.dtype, stored)
    layers = max(1, shape.num_layers)
    weights = shape.weight_bytes * served / stored
    # Layer weights follow the stage's share of layers; embeddings and head ride along.
    per_rank_weights = weights * stage_layers / layers / tp
    kv_heads_per_rank = max(1, math.ceil(shape.num_kv_heads / tp))
    slots = max(1, config.batch_size)
    kv = 2 * stage_layers * kv_heads_per_rank * shape.head_dim * max_seq_len * slots * served
    return RankMemory(int(per_rank_weights), int(kv), RUNTIME_OVERHEAD_BYTES)
