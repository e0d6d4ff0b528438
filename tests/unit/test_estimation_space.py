"""Configuration space: the constraints on (tp, pp) and the papers' 180 configurations."""

from __future__ import annotations

import numpy as np
import pytest

from services.estimation.space import (
    CONFIG_DTYPE,
    ModelShape,
    Variant,
    enumerate_space,
    parallel_pairs,
    standard_variants,
)

LLAMA_2_70B = ModelShape("llama-2-70b", num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128)
FALCON_7B = ModelShape("falcon-7b", num_layers=32, num_heads=71, num_kv_heads=1, head_dim=64)


def test_eight_devices_give_fifteen_parallel_layouts():
    pairs = parallel_pairs(LLAMA_2_70B, 8)
    assert len(pairs) == 15
    assert pairs[:3] == ((1, 1), (1, 2), (1, 3))
    assert (8, 1) in pairs and (8, 2) not in pairs and (4, 2) in pairs and (2, 4) in pairs
    assert all(tp * pp <= 8 for tp, pp in pairs)


def test_llama_2_70b_on_eight_gpus_has_the_papers_180_configurations():
    variants = standard_variants(prunings=("2:4", "wanda", "sparsegpt", "structured-20"))
    assert len(variants) == 12  # 4 weight quantizations x 2 KV + 4 pruning methods
    space = enumerate_space(LLAMA_2_70B, 8, variants)
    assert space.size == 180
    assert space.configs.dtype == CONFIG_DTYPE
    assert len({tuple(row) for row in space.configs.tolist()}) == 180


def test_tp_must_divide_heads_and_kv_heads():
    # Falcon-7B has 71 heads: only tp = 1, pp 1..8.
    assert parallel_pairs(FALCON_7B, 8) == tuple((1, pp) for pp in range(1, 9))
    odd_kv = ModelShape("odd", num_layers=40, num_heads=40, num_kv_heads=10, head_dim=128)
    assert {tp for tp, _ in parallel_pairs(odd_kv, 8)} == {1, 2}


def test_pp_is_bounded_by_layers_and_devices():
    two_layers = ModelShape("tiny", num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16)
    assert parallel_pairs(two_layers, 8) == ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2))
    assert parallel_pairs(LLAMA_2_70B, 3) == ((1, 1), (1, 2), (1, 3), (2, 1))


def test_batches_multiply_the_space_and_rows_are_grouped_by_variant():
    variants = standard_variants(("fp16", "int4"), ("fp16",))
    space = enumerate_space(LLAMA_2_70B, 8, variants, batch_sizes=[4, 1, 2, 2])
    assert space.size == 2 * 15 * 3
    assert np.all(np.diff(space.variant) >= 0)
    assert space.batch[:3].tolist() == [1, 2, 4]
    assert np.array_equal(space.device_count, space.tp * space.pp)
    assert space.describe(0) == "tp=1 pp=1 fp16/kv-fp16 batch=1"
    with pytest.raises(ValueError):
        space.configs["tp"][0] = 8  # read-only


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="weight quantization 'int3'"):
        Variant("x", weight_quant="int3")
    with pytest.raises(ValueError, match="KV-cache quantization"):
        Variant("x", kv_quant="int4")
    with pytest.raises(ValueError, match="num_kv_heads must be positive"):
        ModelShape("bad", 2, 2, 0, 8)
    with pytest.raises(ValueError, match="batch sizes must be positive"):
        enumerate_space(LLAMA_2_70B, 8, standard_variants(), batch_sizes=[0])
    with pytest.raises(ValueError, match="at least one variant"):
        enumerate_space(LLAMA_2_70B, 8, [])
    with pytest.raises(ValueError, match="devices must be positive"):
        parallel_pairs(LLAMA_2_70B, 0)


def test_kv_bytes_per_token_follow_the_architecture():
    # 2 (K and V) x 80 layers x 8 KV heads x 128 x 2 bytes
    assert LLAMA_2_70B.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2
    assert LLAMA_2_70B.kv_bytes_per_token("int8") == 2 * 80 * 8 * 128
