"""Pure deployment decisions: explicit configs, memory per rank, device choice, layers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy_svc.explicit import checkpoint_for, resolve_explicit, token_limits
from deploy_svc.placement import Candidate, even_layer_map
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.errors import InvalidArgument, Unimplemented
from services.reservation import RUNTIME_OVERHEAD_BYTES, prefill_activation_bytes, rank_memory

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


@pytest.mark.parametrize(
    ("positions", "requested", "limits"),
    [
        (2048, (0, 0), (512, 256)),  # the defaults, where the context holds them
        (256, (0, 0), (171, 85)),  # a shorter context, split 2:1
        (768, (0, 0), (512, 256)),
        (2, (0, 0), (1, 1)),
        (1, (0, 0), (0, 1)),  # no room for both: refused below
        (256, (200, 0), (200, 56)),  # one limit given: the other gets what is left
        (256, (0, 100), (156, 100)),
        (2048, (1000, 0), (1000, 256)),
        (0, (0, 0), (512, 256)),  # context unknown
        (256, (128, 128), (128, 128)),
    ],
)
def test_token_limits_default_to_what_the_context_holds(positions, requested, limits):
    if min(limits) < 1:
        with pytest.raises(InvalidArgument, match="hold no input and output"):
            token_limits(*requested, positions)
        return
    assert token_limits(*requested, positions) == limits


@pytest.mark.parametrize(
    ("requested", "phrase"),
    [
        ((256, 0), "max_input_tokens 256 leaves no room for output in the model's 256 positions"),
        ((300, 0), "max_input_tokens 300 leaves no room for output"),
        ((0, 256), "max_output_tokens 256 leaves no room for input"),
        ((200, 57), "= 257 exceeds the model's 256 positions"),
    ],
)
def test_token_limits_beyond_the_context_are_invalid(requested, phrase):
    with pytest.raises(InvalidArgument, match=phrase):
        token_limits(*requested, 256)


@given(
    positions=st.integers(1, 1 << 17),
    max_in=st.integers(0, 1 << 17),
    max_out=st.integers(0, 1 << 17),
)
def test_token_limits_fit_the_context_and_keep_what_was_asked(positions, max_in, max_out):
    try:
        got_in, got_out = token_limits(max_in, max_out, positions)
    except InvalidArgument:
        alone = max(max_in, max_out) if not (max_in and max_out) else 0
        assert max_in + max_out > positions or alone >= positions or positions < 2
        return
    assert got_in >= 1 and got_out >= 1 and got_in + got_out <= positions
    assert got_in == (max_in or got_in) and got_out == (max_out or got_out)


def test_a_short_context_model_deploys_with_default_limits():
    plan = _resolve(_model(max_position_embeddings=256))
    assert (plan.max_input_tokens, plan.max_output_tokens, plan.max_seq_len) == (171, 85, 256)


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
        (common.DeploymentConfig(tensor_parallel=16), {}, InvalidArgument, "one of"),
        (common.DeploymentConfig(pipeline_parallel=5), {}, InvalidArgument, "pipeline_parallel"),
        (common.DeploymentConfig(), {"max_input_tokens": 2048}, InvalidArgument, "no room"),
        (
            common.DeploymentConfig(),
            {"max_input_tokens": 2000, "max_output_tokens": 100},
            InvalidArgument,
            "= 2100 exceeds the model's 2048 positions",
        ),
        (common.DeploymentConfig(), {"batch_size": 1000}, InvalidArgument, "batch_size"),
        (common.DeploymentConfig(variant_name="int4"), {}, InvalidArgument, "no variant"),
        (
            common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_GPTQ_INT4),
            {},
            Unimplemented,
            "pre-quantized GPTQ/AWQ",
        ),
        (common.DeploymentConfig(weight_quant=17), {}, InvalidArgument, "weight_quant 17"),
        (common.DeploymentConfig(pruning=9), {}, InvalidArgument, "pruning 9"),
        (common.DeploymentConfig(dtype=common.PRECISION_FLOAT16), {}, Unimplemented, "float32"),
    ],
)
def test_bad_configs(config, kw, error, phrase):
    with pytest.raises(error, match=phrase):
        _resolve(config=config, **kw)


@pytest.mark.parametrize(
    ("stored", "cuda", "served"),
    [
        # float32 on CPUs whatever the checkpoint holds: profiling jobs compute in it
        # there, so the estimates describe what is served (engine_rules.default_dtype).
        (common.PRECISION_FLOAT16, False, common.PRECISION_FLOAT32),
        (common.PRECISION_BFLOAT16, False, common.PRECISION_FLOAT32),
        (common.PRECISION_FLOAT32, False, common.PRECISION_FLOAT32),
        (common.PRECISION_UNSPECIFIED, False, common.PRECISION_FLOAT32),
        # The checkpoint's own dtype on CUDA devices.
        (common.PRECISION_FLOAT16, True, common.PRECISION_FLOAT16),
        (common.PRECISION_BFLOAT16, True, common.PRECISION_BFLOAT16),
        (common.PRECISION_UNSPECIFIED, True, common.PRECISION_FLOAT32),
    ],
)
def test_an_unset_dtype_is_the_one_profiling_computes_in(stored, cuda, served):
    plan = _resolve(model=_model(dtype=stored), cuda=cuda)
    assert plan.config.dtype == served
    # Asked for by name, float16 on CPUs is still refused, bfloat16 taken.
    with pytest.raises(Unimplemented, match="float32"):
        _resolve(
            model=_model(dtype=stored),
            config=common.DeploymentConfig(dtype=common.PRECISION_FLOAT16),
        )
    asked = _resolve(
        model=_model(dtype=stored), config=common.DeploymentConfig(dtype=common.PRECISION_BFLOAT16)
    )
    assert asked.config.dtype == common.PRECISION_BFLOAT16


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "pp", "ok"),
    [
        (8, 4, 2, 2, True),  # KV heads split
        (8, 4, 8, 1, True),  # fewer KV heads than ranks: replicated
        (8, 1, 4, 1, True),  # multi-query
        (8, 4, 1, 4, True),  # pipeline only
        (4, 2, 8, 1, False),  # more ranks than attention heads
        (12, 3, 2, 1, False),  # 2 neither divides 3 KV heads nor is a multiple of them
    ],
)
def test_parallel_configs_need_splittable_heads(heads, kv_heads, tp, pp, ok):
    model = _model(num_attention_heads=heads, num_kv_heads=kv_heads, intermediate_size=512)
    config = common.DeploymentConfig(tensor_parallel=tp, pipeline_parallel=pp)
    if ok:
        plan = _resolve(model=model, config=config)
        assert (plan.config.tensor_parallel, plan.config.pipeline_parallel) == (tp, pp)
    else:
        with pytest.raises(InvalidArgument, match="divide"):
            _resolve(model=model, config=config)


def test_tensor_parallel_must_divide_the_mlp_width():
    model = _model(intermediate_size=300)
    with pytest.raises(InvalidArgument, match="MLP width 300"):
        _resolve(model=model, config=common.DeploymentConfig(tensor_parallel=8))


@pytest.mark.parametrize(
    "config",
    [
        common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_INT8),
        common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_INT4),
        common.DeploymentConfig(kv_quant=common.KV_QUANT_INT8),
        common.DeploymentConfig(pruning=common.PRUNING_SEMI_STRUCTURED_2_4),
        common.DeploymentConfig(
            weight_quant=common.WEIGHT_QUANT_INT4,
            kv_quant=common.KV_QUANT_INT8,
            pruning=common.PRUNING_STRUCTURED,
        ),
    ],
)
def test_compressed_configs_resolve(config):
    plan = _resolve(config=config)
    for field in ("weight_quant", "kv_quant", "pruning"):
        assert getattr(plan.config, field) == (getattr(config, field) or 1)


def test_a_variant_by_name_fills_in_its_compression():
    model = _model()
    model.variants.add(name="int8", weight_quant=common.WEIGHT_QUANT_INT8)
    model.variants.add(name="own", kv_quant=common.KV_QUANT_INT8, checkpoint_path="own-ckpt")
    plan = _resolve(model, common.DeploymentConfig(variant_name="int8"))
    assert plan.config.weight_quant == common.WEIGHT_QUANT_INT8
    assert plan.config.kv_quant == common.KV_QUANT_NONE
    assert checkpoint_for(model, plan.config) == model.checkpoint_path
    own = _resolve(model, common.DeploymentConfig(variant_name="own"))
    assert own.config.kv_quant == common.KV_QUANT_INT8
    assert checkpoint_for(model, own.config) == "own-ckpt"
    with pytest.raises(InvalidArgument, match="contradicts variant 'int8'"):
        _resolve(
            model,
            common.DeploymentConfig(variant_name="int8", weight_quant=common.WEIGHT_QUANT_INT4),
        )
    with pytest.raises(InvalidArgument, match="has no variant 'nope'"):
        _resolve(model, common.DeploymentConfig(variant_name="nope"))
    # A refused name comes back cut to a readable length (docs/security.md).
    with pytest.raises(InvalidArgument, match=r"has no variant 'ZQQ.*\(10001 characters\)") as cut:
        _resolve(model, common.DeploymentConfig(variant_name="Z" + "Q" * 10_000))
    assert len(str(cut.value)) < 200


def _llama_7b_shape() -> model_pb.ModelShape:
    """Llama-2-7B: 32 layers of 202,383,360 weights, a 32000 x 4096 embedding and head."""
    return model_pb.ModelShape(
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=32,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        parameter_count=32 * 202_383_360 + 2 * 32000 * 4096,
        weight_bytes=2 * (32 * 202_383_360 + 2 * 32000 * 4096),
        dtype=common.PRECISION_BFLOAT16,
    )


def test_rank_memory_counts_quantized_and_pruned_weights():
    shape = _llama_7b_shape()
    layers, embeddings = 32 * 202_383_360, 2 * 32000 * 4096

    def weights(**config) -> int:
        return rank_memory(shape, common.DeploymentConfig(**config), 1024, 32).weights_bytes

    # The embedding and LM head are the rank's fixed part, in the served dtype, with the
    # longest prefill's activations: 1024 tokens of (8 * 4096 + 5 * 11008) values, and
    # the last token's logits.
    prefill = 1024 * (8 * 4096 + 5 * 11008) * 2 + 32000 * 8
    for quant in (common.WEIGHT_QUANT_NONE, common.WEIGHT_QUANT_INT4):
        config = common.DeploymentConfig(weight_quant=quant)
        memory = rank_memory(shape, config, 1024, 32)
        assert prefill_activation_bytes(shape, config, 1024) == prefill
        assert memory.overhead_bytes == RUNTIME_OVERHEAD_BYTES + 2 * embeddings + prefill
    assert weights() == 2 * layers
    assert weights(pruning=common.PRUNING_SEMI_STRUCTURED_2_4) == weights()  # dense zeros
    # int8: 1 byte + a bfloat16 scale per 4096-wide row; int4: 0.5 byte + 4 per 128.
    assert weights(weight_quant=common.WEIGHT_QUANT_INT8) == int(layers * (1 + 2 / 4096))
    assert weights(weight_quant=common.WEIGHT_QUANT_INT4) == int(layers * (0.5 + 4 / 128))
    # Structured 25 %: 24 of 32 heads (q, k, v, o) and 8256 of 11008 channels stay.
    attention, mlp = 4 * 4096 * 4096, 3 * 4096 * 11008
    kept = 32 * (attention * 24 / 32 + mlp * 8256 / 11008)
    # (the norms, 0.004 % of a layer, are counted with the MLP)
    assert weights(pruning=common.PRUNING_STRUCTURED) == pytest.approx(2 * kept, rel=1e-4)
    assert weights(pruning=common.PRUNING_STRUCTURED, weight_quant=common.WEIGHT_QUANT_INT4) < (
        weights(weight_quant=common.WEIGHT_QUANT_INT4)
    )


def test_rank_memory_counts_int8_and_pruned_kv_caches():
    shape = _llama_7b_shape()

    def kv(**config) -> int:
        return rank_memory(shape, common.DeploymentConfig(**config), 1024, 32).kv_cache_bytes

    assert kv() == 2 * 32 * 32 * 128 * 1024 * 2
    # int8 values and one bfloat16 scale per 128-value head vector
    assert kv(kv_quant=common.KV_QUANT_INT8) == 2 * 32 * 32 * 1024 * (128 + 2)
    assert kv(pruning=common.PRUNING_STRUCTURED) == kv() * 24 // 32


def test_rank_memory_splits_weights_and_kv():
    shape = _model().shape
    one = rank_memory(shape, common.DeploymentConfig(tensor_parallel=1, batch_size=1), 1000, 4)
    assert one.weights_bytes == 100 * MIB
    assert one.kv_cache_bytes == 2 * 4 * 4 * 32 * 1000 * 1 * 4
    prefill = prefill_activation_bytes(shape, common.DeploymentConfig(), 1000)
    assert prefill >= 1000 * 4 * shape.hidden_size * 4  # the residual stream at least
    assert one.total_bytes == (
        one.weights_bytes + one.kv_cache_bytes + RUNTIME_OVERHEAD_BYTES + prefill
    )
    half = rank_memory(shape, common.DeploymentConfig(tensor_parallel=2, batch_size=1), 1000, 2)
    # A quarter of the weights, and the norms and output biases each rank holds whole.
    vectors = 2 * 6 * 256 * 4 // 2
    assert half.weights_bytes == 25 * MIB + vectors
    assert half.kv_cache_bytes == one.kv_cache_bytes // 4
    bf16 = rank_memory(shape, common.DeploymentConfig(dtype=common.PRECISION_BFLOAT16), 1000, 4)
    assert bf16.weights_bytes == 50 * MIB


def _dev(node, dev, free, load=0.0):
    return Candidate(node, dev, free * MIB, load)


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
