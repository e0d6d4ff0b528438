"""From registration to estimates on the real stack: a model registered with profiling
is profiled on the node's virtual CPU devices, and the estimator then gives a figure
for every configuration it may be deployed with on them. Variants the model cannot
take are refused at registration."""

from __future__ import annotations

import grpc
import pytest

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import estimator_service_pb2 as estimator_pb
from services.api import estimator_service_pb2_grpc
from services.api import model_service_pb2 as model_pb
from services.estimation.space import ModelShape, Variant, enumerate_space
from services.reservation import layer_weight_bytes
from tests.integration.helpers import TINY, make_checkpoint, rid

pytestmark = pytest.mark.integration

HARDWARE = "cpu-x86_64"
DEVICES = 2
OUTPUT_TOKENS = 16
WATCH_TIMEOUT_S = 900
KV8 = common.CompressionVariant(
    name="kv8",
    weight_quant=common.WEIGHT_QUANT_NONE,
    kv_quant=common.KV_QUANT_INT8,
    pruning=common.PRUNING_NONE,
)


@pytest.fixture(scope="module")
def estimator(stack):
    channel = grpc.insecure_channel(stack.settings.address("estimator"))
    yield estimator_service_pb2_grpc.EstimatorServiceStub(channel)
    channel.close()


def _hardware_types(stack) -> set[str]:
    cluster = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    return {d.hardware_type for n in cluster.nodes for d in n.devices}


def _register_and_profile(stack, model_id: str, path: str, **fields) -> model_pb.Model:
    """Register ``model_id`` with profiling and wait until it is PROFILED."""
    model = stack.models.RegisterModel(
        model_pb.RegisterModelRequest(
            request_id=rid(), model_id=model_id, checkpoint_path=path, **fields
        )
    ).model
    assert model.state == model_pb.MODEL_STATE_PROFILING
    events = list(
        stack.models.WatchModel(
            model_pb.WatchModelRequest(request_id=rid(), model_id=model_id),
            timeout=WATCH_TIMEOUT_S,
        )
    )
    assert events[-1].state == model_pb.MODEL_STATE_PROFILED, events[-1]
    return model


def test_profiled_model_has_an_estimate_for_every_configuration(stack, estimator):
    if _hardware_types(stack) != {HARDWARE}:
        pytest.skip(f"the node's devices are {_hardware_types(stack)}, not {HARDWARE}")
    path = make_checkpoint(stack, "pte-llama", **TINY)
    model = _register_and_profile(stack, "pte-llama", path, variants=[KV8])
    try:
        profile = stack.models.GetProfile(model_pb.GetProfileRequest(model_id="pte-llama"))
        assert not profile.skipped, list(profile.skipped)
        assert {m.hardware_type for m in profile.measurements} == {HARDWARE}

        reply = estimator.EstimateConfigs(
            estimator_pb.EstimateConfigsRequest(
                request_id=rid(),
                model_id="pte-llama",
                hardware_type=HARDWARE,
                workload=estimator_pb.Workload(output_tokens=OUTPUT_TOKENS),
                device_count=DEVICES,
            ),
            timeout=60,
        )
        shape = model.shape
        space = enumerate_space(
            ModelShape(
                "pte-llama",
                shape.num_layers,
                shape.num_attention_heads,
                shape.num_kv_heads,
                shape.head_dim,
            ),
            DEVICES,
            [Variant("base"), Variant("kv8", kv_quant="int8")],
        )
        expected = {
            (int(tp), int(pp), space.variants[v].name, int(b))
            for tp, pp, v, b in zip(space.tp, space.pp, space.variant, space.batch, strict=True)
        }
        # 2 layers, 4 heads in 2 KV groups, 2 devices: (1,1), (1,2), (2,1) per variant.
        assert len(expected) == 6
        got = [
            (
                e.config.tensor_parallel,
                e.config.pipeline_parallel,
                e.config.variant_name or "base",
                e.config.batch_size or 1,
            )
            for e in reply.estimates
        ]
        assert len(got) == len(set(got)) and set(got) == expected, got
        for e in reply.estimates:
            assert e.ttft_ms > 0 and e.tpot_ms > 0 and e.latency_ms > 0, e
            assert e.memory_total_bytes > 0 and e.memory_per_device_bytes > 0, e
            assert e.kv_cache_bytes > 0, e
            devices = e.config.tensor_parallel * e.config.pipeline_parallel
            assert e.memory_per_device_bytes * devices >= e.memory_total_bytes * 0.999, e
            if e.config.variant_name == "kv8":
                assert e.config.kv_quant == common.KV_QUANT_INT8, e

        # The profile holds three prompt lengths; a longer prompt's TTFT follows them.
        assert {m.input_tokens for m in profile.measurements} == {64, 256, 1024}

        def base_ttft(prompt: int) -> tuple[float, list[str]]:
            reply = estimator.EstimateConfigs(
                estimator_pb.EstimateConfigsRequest(
                    request_id=rid(),
                    model_id="pte-llama",
                    hardware_type=HARDWARE,
                    workload=estimator_pb.Workload(
                        input_tokens=prompt, output_tokens=OUTPUT_TOKENS
                    ),
                    device_count=1,
                ),
                timeout=60,
            )
            [base] = [e for e in reply.estimates if not e.config.variant_name]
            return base.ttft_ms, list(reply.notes)

        at_1024, notes = base_ttft(1024)
        assert not any("prompt" in n for n in notes), notes
        # On a CPU the memory is the engine's; USED adds each process's runtime (a probe
        # read 0.20 GiB estimated against 829 MiB used, with nothing said).
        assert any("MiB of Python and torch runtime" in n for n in notes), notes
        at_1500, notes = base_ttft(1500)
        assert at_1500 >= at_1024
        said = "from the 256- and 1024-token prompts' along prefill's shape"
        assert any(said in n for n in notes), notes
    finally:
        stack.models.DeleteModel(
            model_pb.DeleteModelRequest(request_id=rid(), model_id="pte-llama")
        )


def test_a_variant_the_model_cannot_take_is_refused_and_nothing_recorded(stack):
    # MLP width 90: 2:4 pruning works on groups of 4 input weights.
    path = make_checkpoint(stack, "pte-mlp90", intermediate_size=90)
    sparse = common.CompressionVariant(
        name="sparse",
        weight_quant=common.WEIGHT_QUANT_NONE,
        kv_quant=common.KV_QUANT_NONE,
        pruning=common.PRUNING_SEMI_STRUCTURED_2_4,
    )
    with pytest.raises(grpc.RpcError) as err:
        stack.models.RegisterModel(
            model_pb.RegisterModelRequest(
                request_id=rid(), model_id="pte-mlp90", checkpoint_path=path, variants=[sparse]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "variant 'sparse' cannot apply to this model: 2:4 pruning needs every projection's "
        "input width divisible by 4; the MLP width is 90"
    )
    with pytest.raises(grpc.RpcError) as err:
        stack.models.GetModel(model_pb.GetModelRequest(model_id="pte-mlp90"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_bfloat16_checkpoint_is_profiled_and_estimated_as_the_cpu_computes_it(stack, estimator):
    # CPUs compute in float32 whatever the checkpoint holds (engine_rules.default_dtype):
    # what a layer's weights and a token's K and V take is float32's, not bfloat16's.
    if _hardware_types(stack) != {HARDWARE}:
        pytest.skip(f"the node's devices are {_hardware_types(stack)}, not {HARDWARE}")
    path = make_checkpoint(stack, "pte-bf16", **{**TINY, "dtype": "bfloat16"})
    model = _register_and_profile(stack, "pte-bf16", path)
    assert model.shape.dtype == common.PRECISION_BFLOAT16
    try:
        fp32 = common.DeploymentConfig(dtype=common.PRECISION_FLOAT32)
        bf16 = common.DeploymentConfig(dtype=common.PRECISION_BFLOAT16)
        profile = stack.models.GetProfile(model_pb.GetProfileRequest(model_id="pte-bf16"))
        assert profile.measurements
        for m in profile.measurements:
            assert m.config.dtype == common.PRECISION_FLOAT32
            assert m.layer_weight_bytes == pytest.approx(layer_weight_bytes(model.shape, fp32))
            assert m.layer_weight_bytes > 1.9 * layer_weight_bytes(model.shape, bf16)
            assert m.layer_kv_bytes_per_token == 2 * TINY["num_kv_heads"] * model.shape.head_dim * 4
        reply = estimator.EstimateConfigs(
            estimator_pb.EstimateConfigsRequest(
                request_id=rid(),
                model_id="pte-bf16",
                hardware_type=HARDWARE,
                workload=estimator_pb.Workload(input_tokens=64, output_tokens=OUTPUT_TOKENS),
                device_count=1,
            ),
            timeout=60,
        )
        [single] = reply.estimates
        layers = model.shape.num_layers
        assert single.memory_total_bytes > layers * layer_weight_bytes(model.shape, fp32)
        kv_per_token = layers * 2 * TINY["num_kv_heads"] * model.shape.head_dim * 4
        assert single.kv_cache_bytes == kv_per_token * (64 + OUTPUT_TOKENS)
    finally:
        stack.models.DeleteModel(model_pb.DeleteModelRequest(request_id=rid(), model_id="pte-bf16"))
