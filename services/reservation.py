"""How much device memory a rank reserves: the one sizing rule of the deployer and the
profiler.

A rank's reservation is a fixed runtime overhead per worker process
(:data:`RUNTIME_OVERHEAD_BYTES`) plus what its share of the model takes, and, for a
deployment, the activations of its longest prefill (:func:`prefill_activation_bytes`):

* a deployment's rank (:func:`rank_memory`, :func:`memory_blocks`), from the model's
  shape: its decoder layers' weights split tp ways, the KV cache for every slot at the
  maximum sequence length on the rank's layers and heads, and the token embedding and
  LM head whole (:func:`embedding_rank_bytes`: the engine replicates them on every
  tensor rank; a Llama-3-70B rank at tp = 8 holds 3.9 GiB of them in bfloat16, eight
  times what a split would say). With the estimator's figure for the configuration
  (its total over all devices), a layer's block is the larger of the two, so a
  reservation never falls below what the shape says a layer takes;
* a profiling job's rank (:func:`fingerprint_rank_bytes`), from the fingerprint's exact
  tensors: its stage's layer tensors split tp ways, the embedding, final norm and LM
  head whole (the engine replicates them), the KV cache and a whole-sequence prefill's
  activations (there is no estimate before a model is profiled).

Compression, as the engine applies it to the decoder layers' projections (embeddings,
norms and the LM head keep the served dtype): int8 weights take 1 byte per weight plus a
bfloat16 scale per output row, int4 half a byte plus a bfloat16 scale and zero per group
of 128 inputs; an int8 KV cache 1 byte per element plus a bfloat16 scale per head vector.
2:4 pruning keeps weights dense (no saving); structured pruning keeps the heads, KV heads
and MLP channels ``services.models.compression`` says for the default fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.engine_rules import even_stage_layers, kv_heads_on_rank
from services.models.arch import ArchSpec
from services.models.compression import (
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_PRUNE_FRACTION,
    kept_heads,
    kept_mlp_channels,
)

MIB = 1 << 20
# Resident memory of an idle PyTorch worker process (interpreter, torch, gRPC), measured
# on CPU; rounded up so reservations cover it.
CPU_RUNTIME_MIB = 330
RUNTIME_OVERHEAD_BYTES = 512 * MIB
DTYPE_BYTES = {
    common.PRECISION_FLOAT32: 4,
    common.PRECISION_FLOAT16: 2,
    common.PRECISION_BFLOAT16: 2,
}
SCALE_BYTES = 2  # bfloat16 quantization scales and zeros


@dataclass(frozen=True)
class RankMemory:
    weights_bytes: int  # the rank's share of its decoder layers
    kv_cache_bytes: int
    overhead_bytes: int  # the runtime's, and the embedding and LM head the rank holds

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
    served, stored = _dtype_bytes(shape, config)
    per_rank_weights = stage_layers * _rank_layer_bytes(shape, config, served, stored, tp)
    kv_heads_per_rank = kv_heads_on_rank(shape.num_kv_heads, tp)
    if config.pruning == common.PRUNING_STRUCTURED and shape.num_kv_heads:
        heads_per_rank = max(1, shape.num_attention_heads // tp)
        _, kv_heads_per_rank = kept_heads(heads_per_rank, kv_heads_per_rank, DEFAULT_PRUNE_FRACTION)
    slots = max(1, config.batch_size)
    kv = kv_cache_bytes(
        stage_layers,
        kv_heads_per_rank,
        shape.head_dim,
        max_seq_len,
        slots,
        _kv_element_bytes(shape, config, served),
    )
    overhead = (
        RUNTIME_OVERHEAD_BYTES
        + embedding_rank_bytes(shape, config)
        + prefill_activation_bytes(shape, config, max_seq_len)
    )
    return RankMemory(int(per_rank_weights), int(kv), overhead)


def prefill_activation_bytes(
    shape: model_pb.ModelShape, config: common.DeploymentConfig, max_seq_len: int
) -> int:
    """Transient bytes of one rank's longest prefill: the engine prefills at most
    ``max_seq_len`` tokens a pass (its default token budget), and a pass holds, within
    one layer, the residual stream and the larger block's activations, linear in its
    tokens (attention runs causally without a [T, T] mask, docs/engine.md), as
    :func:`fingerprint_rank_bytes` counts them; and the last token's logits. A 24k-token
    prompt of a 256-wide model took 3.6 GiB against 653 MiB reserved while the mask was
    built; the linear part alone is still several hundred MiB at such lengths."""
    tp = max(1, config.tensor_parallel)
    served, _ = _dtype_bytes(shape, config)
    return int(
        _layer_activation_bytes(max_seq_len, shape.hidden_size, shape.intermediate_size, tp, served)
        + shape.vocab_size * 8
    )


def _layer_activation_bytes(
    tokens: int, hidden_size: int, intermediate_size: int, tp: int, dtype_bytes: int
) -> int:
    """Activations one layer holds for ``tokens`` tokens on one of ``tp`` ranks: the
    residual stream and the larger block's, linear in the tokens, with what the
    allocator holds beside them. ``bench/prefill_memory.py`` prints the pass's added
    memory less the KV cache it writes against this: ``4H + 3I`` held 0.5-0.6 of it on
    a 256-wide model (a 32k-token prompt's worker went 135-151 MiB past its reservation,
    a probe), ``8H + 5I`` 1.1-1.4 at 4k-16k tokens."""
    return tokens * (8 * hidden_size + 5 * intermediate_size // tp) * dtype_bytes


def embedding_rank_bytes(shape: model_pb.ModelShape, config: common.DeploymentConfig) -> int:
    """Bytes of the token embedding and LM head (served dtype) one rank holds: whole on
    every tensor rank; both on a single-stage pipeline (one matrix when they are tied),
    the embedding on the first stage and the head on the last otherwise (so a rank of any
    stage holds at most one; middle stages are counted as if they held one too)."""
    served, stored = _dtype_bytes(shape, config)
    embedding_params, _ = _split_params(shape, stored)
    if config.pipeline_parallel > 1 and not shape.tie_word_embeddings:
        embedding_params /= 2
    return int(embedding_params * served)


def memory_blocks(
    shape: model_pb.ModelShape,
    config: common.DeploymentConfig,
    max_seq_len: int,
    estimate_total_bytes: int = 0,
) -> tuple[int, int]:
    """(fixed bytes, bytes per decoder layer) of one rank of ``config``: a rank holding
    ``k`` layers reserves ``fixed + k * block``. ``fixed`` is the runtime's overhead and
    the embedding and LM head a rank holds; ``block`` is what the shape says a layer's
    weights and KV cache take, or, when larger, the estimator's figure
    (``estimate_total_bytes``, the papers' ``mem_total``, 0 for none) less ``fixed`` on
    each of its ``tp * pp`` ranks, over ``tp * layers``: the estimate covers the whole
    rank, so a rank of an even split reserves the estimator's ``mem_total / (tp * pp)``
    (its ``fixed`` was counted twice, on top of the estimate, and a configuration the
    estimator said fits was refused room)."""
    layers = max(1, shape.num_layers)
    tp = max(1, config.tensor_parallel)
    pp = max(1, config.pipeline_parallel)
    whole = rank_memory(shape, config, max_seq_len, layers)
    block = math.ceil((whole.total_bytes - whole.overhead_bytes) / layers)
    if estimate_total_bytes:
        net = estimate_total_bytes - tp * pp * whole.overhead_bytes
        block = max(block, math.ceil(net / (tp * layers)))
    return whole.overhead_bytes, block


def even_split_bytes(
    shape: model_pb.ModelShape,
    config: common.DeploymentConfig,
    max_seq_len: int,
    estimate_total_bytes: int = 0,
) -> int:
    """What each device of ``config`` reserves on an even layer map, the stage with the
    most layers': :func:`memory_blocks`' fixed bytes plus that many layers' blocks. A
    configuration fits devices alike of that much memory and no less (an uneven map
    helps only where their free memory differs): the estimator's ``fits`` judged by it
    says what the deployer will place."""
    fixed, block = memory_blocks(shape, config, max_seq_len, estimate_total_bytes)
    layers = max(1, shape.num_layers)
    stages = min(max(1, config.pipeline_parallel), layers)
    return fixed + max(even_stage_layers(layers, stages)) * block


def fingerprint_rank_bytes(
    spec: ArchSpec,
    *,
    tensor_parallel: int,
    stage_layers: tuple[int, ...],
    batch_size: int,
    max_seq_len: int,
    compute_bytes: int,
) -> list[int]:
    """Memory to reserve for each rank (rank = stage·tp + tensor rank) of a profiling job
    on a fingerprint shaped ``spec`` whose stages hold ``stage_layers`` layers."""
    tp = tensor_parallel
    shapes = spec.expected_tensors()
    per_stage, first = [], 0
    for count in stage_layers:
        layer_tensors, other_tensors = set(), set()
        for parameter, source in spec.stage_weights(first, count).items():
            (layer_tensors if parameter.startswith("layers.") else other_tensors).add(source.tensor)
        weights = (
            sum(math.prod(shapes[t]) for t in layer_tensors) / tp
            + sum(math.prod(shapes[t]) for t in other_tensors)
        ) * compute_bytes
        kv_heads = kv_heads_on_rank(spec.num_kv_heads, tp)
        kv = kv_cache_bytes(count, kv_heads, spec.head_dim, max_seq_len, batch_size, compute_bytes)
        tokens = batch_size * max_seq_len
        activations = (
            _layer_activation_bytes(
                tokens, spec.hidden_size, spec.intermediate_size, tp, compute_bytes
            )
            + batch_size * spec.num_heads // tp * max_seq_len * max_seq_len * 4
            + batch_size * spec.vocab_size * 8
        )
        per_stage.append(int(weights + kv + activations) + RUNTIME_OVERHEAD_BYTES)
        first += count
    return [per_stage[rank // tp] for rank in range(len(stage_layers) * tp)]


def kv_cache_bytes(
    layers: int,
    kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    slots: int,
    element_bytes: float,
) -> float:
    """K and V of ``layers`` layers' ``kv_heads`` heads for ``slots`` sequences of
    ``max_seq_len`` positions, ``element_bytes`` per stored element."""
    return 2 * layers * kv_heads * head_dim * max_seq_len * slots * element_bytes


def served_weight_bytes(
    shape: model_pb.ModelShape, config: common.DeploymentConfig, served: int, stored: int
) -> float:
    """Bytes of all the model's weights as a worker holds them: the embedding and LM head
    in the served dtype, the decoder layers pruned and quantized as ``config`` says (see
    the module docstring)."""
    embedding_params, _ = _split_params(shape, stored)
    layers = max(1, shape.num_layers)
    return embedding_params * served + layers * _layer_weight_bytes(shape, config, served, stored)


def layer_weight_bytes(shape: model_pb.ModelShape, config: common.DeploymentConfig) -> float:
    """Bytes of one decoder layer's weights as the engine holds them (all ranks together):
    pruned and quantized as ``config`` says, scales and zeros included; what a profile
    records so that the estimator need not extrapolate weights from fingerprints."""
    return _layer_weight_bytes(shape, config, *_dtype_bytes(shape, config))


def _layer_weight_bytes(
    shape: model_pb.ModelShape, config: common.DeploymentConfig, served: int, stored: int
) -> float:
    per_layer = params_per_layer(shape, stored)
    if config.pruning == common.PRUNING_STRUCTURED:
        per_layer *= _structured_kept_share(shape, per_layer)
    return per_layer * _bytes_per_weight(shape, config, served)


def _bytes_per_weight(
    shape: model_pb.ModelShape, config: common.DeploymentConfig, served: int
) -> float:
    if config.weight_quant == common.WEIGHT_QUANT_INT8:
        # A scale per output row of (at least) hidden_size inputs.
        return 1 + SCALE_BYTES / max(1, shape.hidden_size)
    if config.weight_quant == common.WEIGHT_QUANT_INT4:
        return 0.5 + 2 * SCALE_BYTES / DEFAULT_INT4_GROUP_SIZE
    return served


# Vectors of hidden_size a decoder layer has at most (two norms with biases, the
# attention and MLP output biases): tensor ranks hold them whole.
_VECTORS_PER_LAYER = 6


def _rank_layer_bytes(
    shape: model_pb.ModelShape,
    config: common.DeploymentConfig,
    served: int,
    stored: int,
    tp: int,
) -> float:
    """One decoder layer's weights on one of ``tp`` tensor ranks, as
    ``monitor_agent.engine.tensor_parallel`` shards them: a 1/tp share, plus the K and V
    projections of the KV heads a rank holds beyond its share (each rank holds one whole
    KV head when tp does not divide them) and the vectors ranks hold whole."""
    whole = _layer_weight_bytes(shape, config, served, stored)
    if tp == 1:
        return whole
    extra = _VECTORS_PER_LAYER * shape.hidden_size * served * (1 - 1 / tp)
    kv_heads = shape.num_kv_heads
    if kv_heads:
        held = kv_heads_on_rank(kv_heads, tp)
        kv_weights = 2 * shape.hidden_size * shape.head_dim * (held - kv_heads / tp)
        extra += kv_weights * _bytes_per_weight(shape, config, served)
    return whole / tp + extra


def layer_kv_bytes_per_token(shape: model_pb.ModelShape, config: common.DeploymentConfig) -> float:
    """Bytes one token's K and V take in one decoder layer (all ranks together), in the
    served dtype or int8 with a bfloat16 scale per head vector, as the engine stores them."""
    element = _kv_element_bytes(shape, config, _dtype_bytes(shape, config)[0])
    kv_heads = shape.num_kv_heads
    if config.pruning == common.PRUNING_STRUCTURED and kv_heads:
        _, kv_heads = kept_heads(shape.num_attention_heads, kv_heads, DEFAULT_PRUNE_FRACTION)
    return 2.0 * kv_heads * shape.head_dim * element


def _dtype_bytes(shape: model_pb.ModelShape, config: common.DeploymentConfig) -> tuple[int, int]:
    """(served, stored) bytes per element: the config's dtype, else the checkpoint's."""
    stored = DTYPE_BYTES.get(shape.dtype, 4)
    return DTYPE_BYTES.get(config.dtype, stored), stored


def _kv_element_bytes(
    shape: model_pb.ModelShape, config: common.DeploymentConfig, served: int
) -> float:
    """Bytes of one K or V element: the served dtype, or int8 plus a bfloat16 scale per
    head vector."""
    if config.kv_quant == common.KV_QUANT_INT8:
        return 1 + SCALE_BYTES / max(1, shape.head_dim)
    return served


def params_per_layer(shape: model_pb.ModelShape, stored: int = 2) -> float:
    """Parameters of one decoder layer: all but the embedding and LM head, per layer."""
    return _split_params(shape, stored)[1] / max(1, shape.num_layers)


def _split_params(shape: model_pb.ModelShape, stored: int) -> tuple[float, float]:
    """(embedding and LM head parameters, decoder-layer parameters) of ``shape``."""
    total_params = shape.parameter_count or shape.weight_bytes / stored
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    embedding_params = min(total_params, embeddings)
    return embedding_params, total_params - embedding_params


def _structured_kept_share(shape: model_pb.ModelShape, layer_params: float) -> float:
    """The share of a decoder layer's ``layer_params`` weights structured pruning keeps:
    q/o rows scale with the query heads kept, k/v with the KV heads, the MLP (the rest of
    the layer) with its width. 1 when the shape lacks the sizes."""
    hidden, heads, kv_heads = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads
    dim, inner = shape.head_dim, shape.intermediate_size
    if not (hidden and heads and kv_heads and dim and inner and layer_params):
        return 1.0
    kept_q, kept_kv = kept_heads(heads, kv_heads, DEFAULT_PRUNE_FRACTION)
    q_o, k_v = 2 * hidden * heads * dim, 2 * hidden * kv_heads * dim
    mlp = max(0.0, layer_params - q_o - k_v)
    kept = (
        q_o * kept_q / heads
        + k_v * kept_kv / kv_heads
        + mlp * kept_mlp_channels(inner, DEFAULT_PRUNE_FRACTION) / inner
    )
    return kept / (q_o + k_v + mlp)
