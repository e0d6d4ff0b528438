"""services.reservation: the bytes a layer takes in the engine's formats."""

from __future__ import annotations

import pytest

from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.reservation import (
    layer_kv_bytes_per_token,
    layer_weight_bytes,
    params_per_layer,
    served_weight_bytes,
)

# A Llama-style shape: 4 layers of 64 wide (8 heads of 8, 2 KV heads), MLP 128, vocab 100.
LAYER = 2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 128 + 2 * 64
SHAPE = model_pb.ModelShape(
    hidden_size=64,
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=128,
    vocab_size=100,
    dtype=common.PRECISION_FLOAT32,
    parameter_count=2 * 100 * 64 + 4 * LAYER + 64,
)


@pytest.mark.parametrize(
    ("quant", "per_weight"),
    [
        (common.WEIGHT_QUANT_NONE, 4.0),
        (common.WEIGHT_QUANT_INT8, 1 + 2 / 64),
        (common.WEIGHT_QUANT_INT4, 0.5 + 4 / 128),
    ],
)
def test_layer_bytes_follow_the_format_and_add_up_to_the_served_weights(quant, per_weight):
    config = common.DeploymentConfig(weight_quant=quant)
    per_layer = params_per_layer(SHAPE, 4)
    assert per_layer == pytest.approx(LAYER + 64 / 4)  # the final norm spread over layers
    assert layer_weight_bytes(SHAPE, config) == pytest.approx(per_layer * per_weight)
    whole = served_weight_bytes(SHAPE, config, 4, 4)
    assert whole == pytest.approx(2 * 100 * 64 * 4 + 4 * layer_weight_bytes(SHAPE, config))


def test_kv_bytes_per_token_in_the_served_dtype_or_int8_with_a_scale_per_head_vector():
    plain = common.DeploymentConfig(dtype=common.PRECISION_BFLOAT16)
    assert layer_kv_bytes_per_token(SHAPE, plain) == 2 * 2 * 8 * 2
    assert layer_kv_bytes_per_token(SHAPE, common.DeploymentConfig()) == 2 * 2 * 8 * 4
    int8 = common.DeploymentConfig(kv_quant=common.KV_QUANT_INT8)
    assert layer_kv_bytes_per_token(SHAPE, int8) == pytest.approx(2 * 2 * 8 * (1 + 2 / 8))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (2, 2), (1, 3)])
def test_a_rank_reserves_at_least_the_weights_the_engine_loads_on_it(tmp_path, tp, pp, tied):
    """The engine's own rank (load_model with its TensorShard and stage) against the
    deployer's rule, on a shape whose embedding and LM head outweigh its layers: they
    are replicated on every tensor rank, not split (the rule once divided them by tp and
    by the stage's share of layers, and a tp = 2 rank of a large-vocabulary model used
    more than it reserved)."""
    from fingerprint_svc.registry import model_shape
    from monitor_agent.engine.loader import load_model
    from monitor_agent.engine.tensor_parallel import TensorShard
    from services.models.checkpoint import create_checkpoint, read_config
    from services.models.families import parse_config
    from services.reservation import RUNTIME_OVERHEAD_BYTES, memory_blocks

    layers = 6
    directory = create_checkpoint(
        tmp_path / "ckpt",
        hidden_size=32,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=8192,
        tie_word_embeddings=tied,
    )
    spec = parse_config(read_config(directory))
    shape = model_shape(spec, 0)
    config = common.DeploymentConfig(tensor_parallel=tp, pipeline_parallel=pp, batch_size=1)
    fixed, block = memory_blocks(shape, config, max_seq_len=1)
    per_stage = layers // pp
    for stage in range(pp):
        for rank in range(tp):
            model = load_model(
                directory,
                first_layer=stage * per_stage,
                layer_count=per_stage,
                tensor_parallel=TensorShard(tp, rank) if tp > 1 else None,
            )
            loaded = sum(p.numel() * p.element_size() for p in model.parameters())
            reserved = fixed - RUNTIME_OVERHEAD_BYTES + per_stage * block
            assert loaded <= reserved, (stage, rank, loaded, reserved)
            # Not wildly above either: at most one unneeded embedding-sized matrix.
            assert reserved - loaded <= 8192 * 32 * 4 + per_stage * block


@pytest.mark.parametrize(
    ("tp", "pp", "quant", "estimate"),
    [
        (1, 1, common.WEIGHT_QUANT_NONE, 0),
        (2, 1, common.WEIGHT_QUANT_INT4, 0),
        (1, 3, common.WEIGHT_QUANT_INT8, 0),  # 4 layers over 3 stages: one holds two
        (2, 2, common.WEIGHT_QUANT_NONE, 64 << 20),  # an estimate above the shape's figure
    ],
)
def test_an_even_split_fits_devices_of_exactly_its_bytes_and_no_fewer(tp, pp, quant, estimate):
    """even_split_bytes is the estimator's "fits" and the deployer's placement agrees
    with it both ways (a 70B int4 estimate fitted 34 GiB devices the deployer refused)."""
    from deploy_svc import placement
    from services.reservation import even_split_bytes, memory_blocks

    config = common.DeploymentConfig(
        tensor_parallel=tp, pipeline_parallel=pp, weight_quant=quant, batch_size=2
    )
    need = even_split_bytes(SHAPE, config, 512, estimate)
    fixed, block = memory_blocks(SHAPE, config, 512, estimate)
    assert need == fixed + -(-SHAPE.num_layers // pp) * block

    def placed(free: int) -> bool:
        devices = [placement.Candidate("n", f"d{i}", free, 0.0) for i in range(tp * pp)]
        choice = placement.place(
            devices, tp=tp, pp=pp, num_layers=SHAPE.num_layers, fixed_bytes=fixed, layer_bytes=block
        )
        return choice is not None

    assert placed(need) and not placed(need - 1)
