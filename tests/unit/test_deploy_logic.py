"""Pure deployment decisions: explicit configs, memory per rank, device choice, layers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy_svc.explicit import resolve_explicit
from deploy_svc.memory import RUNTIME_OVERHEAD_BYTES, rank_memory
from deploy_svc.placement import Candidate, choose_devices, even_layer_map
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.errors import InvalidArgument, Unimplemented

MIB = 1 << 20


def _model(**shape) -> model_pb.Model:
    base = dict(
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=32,
        hidden_size=256,
        max_position_embeddings=2048,
        weight_bytes=100 * MIB,
        dtype=common.PRECISION_FLOAT32,
    )
    return model_pb.Model(model_id="m", shape=model_pb.ModelShape(**{**base, **shape}))


def _resolve(model=None, config=None, **kw):
    kw = {"batch_size": 0, "max_input_tokens": 0, "max_output_tokens": 0, **kw}
    return resolve_explicit(model or _model(), config or common.DeploymentConfig(), **kw)


def test_defaults_fill_in():
    plan = _resolve()
    c = plan.config
    assert (c.tensor_parallel, c.pipeline_parallel, c.batch_size) == (1, 1, 1)
    assert c.weight_quant == common.WEIGHT_QUANT_NONE and c.dtype == common.PRECISION_FLOAT32
    assert (plan.max_input_tokens, plan.max_output_tokens, plan.max_seq_len) == (512, 256, 768)


@pytest.mark.parametrize(
    "config,kw,error,phrase",
    [
        (common.DeploymentConfig(tensor_parallel=3), {}, InvalidArgument, "one of"),
        (common.DeploymentConfig(tensor_parallel=8), {}, InvalidArgument, "divide"),
        (common.DeploymentConfig(pipeline_parallel=5), {}, InvalidArgument, "pipeline_parallel"),
        (common.DeploymentConfig(), {"max_input_tokens": 2000}, InvalidArgument, "positions"),
        (common.DeploymentConfig(), {"batch_size": 1000}, InvalidArgument, "batch_size"),
        (common.DeploymentConfig(variant_name="int4"), {}, InvalidArgument, "no variant"),
        (common.DeploymentConfig(tensor_parallel=2), {}, Unimplemented, "issue 3"),
        (
            common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_INT8),
            {},
            Unimplemented,
            "issue 3",
        ),
        (common.DeploymentConfig(dtype=common.PRECISION_FLOAT16), {}, Unimplemented, "float32"),
    ],
)
def test_bad_configs(config, kw, error, phrase):
    with pytest.raises(error, match=phrase):
        _resolve(config=config, **kw)


def test_rank_memory_splits_weights_and_kv():
    shape = _model().shape
    one = rank_memory(shape, common.DeploymentConfig(tensor_parallel=1, batch_size=1), 1000, 4)
    assert one.weights_bytes == 100 * MIB
    assert one.kv_cache_bytes == 2 * 4 * 4 * 32 * 1000 * 1 * 4
    assert one.total_bytes == one.weights_bytes + one.kv_cache_bytes + RUNTIME_OVERHEAD_BYTES
    half = rank_memory(shape, common.DeploymentConfig(tensor_parallel=2, batch_size=1), 1000, 2)
    assert half.weights_bytes == 25 * MIB and half.kv_cache_bytes == one.kv_cache_bytes // 4
    bf16 = rank_memory(shape, common.DeploymentConfig(dtype=common.PRECISION_BFLOAT16), 1000, 4)
    assert bf16.weights_bytes == 50 * MIB


def _dev(node, dev, free, load=0.0):
    return Candidate(node, dev, free * MIB, load)


def test_choose_devices_packs_and_prefers_one_node():
    devices = [_dev("a", "0", 900), _dev("a", "1", 300), _dev("b", "0", 200), _dev("b", "1", 250)]
    assert [d.device_id for d in choose_devices(devices, 1, 220 * MIB)] == ["1"]
    pair = choose_devices(devices, 2, 200 * MIB)
    assert {d.node_id for d in pair} == {"b"}
    assert choose_devices(devices, 3, 800 * MIB) is None


@given(st.integers(1, 200), st.integers(1, 8))
def test_even_layer_map_covers_every_layer_once(layers, stages):
    if stages > layers:
        with pytest.raises(ValueError):
            even_layer_map(layers, stages)
        return
    plan = even_layer_map(layers, stages)
    assert len(plan) == stages
    assert [f for f, _ in plan] == [sum(c for _, c in plan[:i]) for i in range(stages)]
    counts = [c for _, c in plan]
    assert sum(counts) == layers and min(counts) >= 1 and max(counts) - min(counts) <= 1
