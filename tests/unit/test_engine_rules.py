"""What the engine can run, asked in one place: the rules themselves, and the estimator's
space agreeing with the deployer on every model shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy_svc.explicit import resolve_explicit
from monitor_agent.devices import DeviceSpec
from monitor_agent.launch import worker_dtype
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.engine_rules import (
    check_dtype,
    check_weight_quant,
    parallel_problem,
    tensor_parallel_problem,
)
from services.errors import InvalidArgument, IServeError, Unimplemented
from services.estimation.profiles import estimation_shape
from services.estimation.space import Variant, enumerate_space


def _model(heads: int, kv_heads: int, mlp_width: int, layers: int) -> model_pb.Model:
    return model_pb.Model(
        model_id="m",
        shape=model_pb.ModelShape(
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=16,
            hidden_size=16 * heads,
            intermediate_size=mlp_width,
            max_position_embeddings=2048,
            weight_bytes=1 << 20,
            dtype=common.PRECISION_FLOAT32,
        ),
    )


@pytest.mark.parametrize(
    ("tp", "shape", "problem"),
    [
        (3, (12, 12, 48), "must be one of (1, 2, 4, 8)"),
        (2, (3, 3, 48), "must divide the 3 attention heads"),
        (2, (6, 3, 48), "must divide the 3 KV heads or be a multiple of them"),
        (2, (4, 2, 51), "must divide the MLP width 51"),
        (2, (4, 1, 48), None),  # multi-query: the KV head is replicated
        (8, (8, 2, 64), None),  # a multiple of the KV heads
        (2, (4, 2, 0), None),  # MLP width unknown: not checked
    ],
)
def test_tensor_parallel_rules(tp, shape, problem):
    heads, kv_heads, mlp_width = shape
    found = tensor_parallel_problem(tp, heads=heads, kv_heads=kv_heads, mlp_width=mlp_width)
    assert found == problem or (problem and problem in found)


def test_pipeline_stages_are_bounded_by_eight_and_the_layers():
    common_shape = {"heads": 4, "kv_heads": 4, "mlp_width": 64}
    assert parallel_problem(1, 8, num_layers=80, **common_shape) is None
    assert "1..8 for 80 layers" in parallel_problem(1, 9, num_layers=80, **common_shape)
    assert "1..2 for 2 layers" in parallel_problem(1, 3, num_layers=2, **common_shape)


def test_dtypes_and_pre_quantized_checkpoints():
    check_dtype(common.PRECISION_BFLOAT16, cuda=False)
    check_dtype(common.PRECISION_FLOAT16, cuda=True)
    with pytest.raises(Unimplemented, match="CPU engine serves float32 and bfloat16, not float16$"):
        check_dtype(common.PRECISION_FLOAT16, cuda=False)
    with pytest.raises(Unimplemented, match="GPTQ/AWQ"):
        check_weight_quant(common.WEIGHT_QUANT_AWQ_INT4)
    check_weight_quant(common.WEIGHT_QUANT_INT4)


def test_the_space_leaves_out_a_tensor_parallel_split_of_the_mlp_the_engine_cannot_make():
    model = _model(heads=4, kv_heads=2, mlp_width=130, layers=4)  # 130 / 4 is not whole
    pairs = {(int(c["tp"]), int(c["pp"])) for c in _space(model).configs}
    assert (2, 1) in pairs and (4, 1) not in pairs


def _space(model: model_pb.Model, variants: tuple[Variant, ...] = ()):
    return enumerate_space(estimation_shape(model), 8, variants or (Variant("fp16"),))


COMPRESSED = (
    Variant("fp16"),
    Variant("int4", weight_quant="int4"),
    Variant("sparse", pruning="2:4"),
    Variant("pruned", pruning="structured"),
    Variant("int4-pruned", weight_quant="int4", pruning="structured"),
)


def _as_config(variant: Variant, tp: int, pp: int) -> common.DeploymentConfig:
    return common.DeploymentConfig(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        weight_quant=common.WEIGHT_QUANT_INT4 if variant.weight_quant == "int4" else 0,
        pruning={
            "2:4": common.PRUNING_SEMI_STRUCTURED_2_4,
            "structured": common.PRUNING_STRUCTURED,
        }.get(variant.pruning or "", 0),
    )


def test_int4_at_a_tensor_split_whose_share_of_the_mlp_its_groups_do_not_divide():
    """MLP 360 splits into 180 per rank at tp = 2: no int4 group of 8 divides it, so
    int4 runs at tp = 1 only (a probe saw int4 at tp = 2 estimated at half its tp = 1
    memory, ranked first by every intent, and launched before failing in the worker);
    2:4's groups of 4 do divide it. The deployer refuses it before any launch."""
    model = _model(heads=4, kv_heads=2, mlp_width=360, layers=2)
    space = _space(model, COMPRESSED)
    runs = {(space.variants[int(c["variant"])].name, int(c["tp"])) for c in space.configs}
    assert ("int4", 1) in runs and ("int4", 2) not in runs
    assert ("fp16", 2) in runs and ("sparse", 2) in runs
    with pytest.raises(
        InvalidArgument,
        match=r"^m at tp=2: int4 weight quantization needs every projection's input width "
        r"divisible by 8; the MLP width on each of 2 tensor ranks is 180$",
    ):
        resolve_explicit(
            model,
            _as_config(COMPRESSED[1], 2, 1),
            batch_size=1,
            max_input_tokens=0,
            max_output_tokens=0,
        )


@given(
    heads=st.integers(1, 24),
    kv_divisor=st.integers(1, 24),
    mlp_width=st.integers(1, 400),
    layers=st.integers(1, 12),
)
def test_every_configuration_the_estimator_ranks_is_one_the_deployer_runs(
    heads, kv_divisor, mlp_width, layers
):
    """The estimator ranks from its space; whichever configuration comes first, the
    deployer must not skip it for an engine reason."""
    kv_heads = heads // kv_divisor if heads % kv_divisor == 0 else heads
    model = _model(heads, kv_heads, mlp_width, layers)
    space = _space(model, COMPRESSED)
    for config in space.configs:
        tp, pp = int(config["tp"]), int(config["pp"])
        variant = space.variants[int(config["variant"])]
        requested = _as_config(variant, tp, pp)
        try:
            resolve_explicit(
                model, requested, batch_size=1, max_input_tokens=0, max_output_tokens=0
            )
        except IServeError as exc:
            pytest.fail(
                f"the estimator ranks {variant.name} tp={tp} pp={pp} but the deployer "
                f"refuses: {exc}"
            )
    assert (1, 1) in {(int(c["tp"]), int(c["pp"])) for c in _space(model).configs}


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("stored", [None, "float32", "float16", "bfloat16"])
def test_the_deployer_and_the_worker_default_to_the_same_dtype(stored, cuda):
    """A deployment with no dtype is reserved and estimated for the dtype the deployer
    resolves, and profiled in the one the worker picks: the two must agree."""
    precision = {
        None: common.PRECISION_UNSPECIFIED,
        "float32": common.PRECISION_FLOAT32,
        "float16": common.PRECISION_FLOAT16,
        "bfloat16": common.PRECISION_BFLOAT16,
    }[stored]
    model = _model(8, 8, 512, 4)
    model.shape.dtype = precision
    resolved = resolve_explicit(
        model,
        common.DeploymentConfig(),
        batch_size=0,
        max_input_tokens=0,
        max_output_tokens=0,
        cuda=cuda,
    ).config.dtype
    device = DeviceSpec(
        device_id="d0",
        kind=common.DEVICE_KIND_CUDA if cuda else common.DEVICE_KIND_CPU_VIRTUAL,
        name="d0",
        hardware_type="h",
        total_bytes=1 << 30,
        cpu_cores=(0,),
        cuda_index=0 if cuda else None,
    )
    worker = worker_dtype(common.PRECISION_UNSPECIFIED, device, stored)
    assert worker == common.Precision.Name(resolved).removeprefix("PRECISION_").lower()
    assert worker == (stored if cuda and stored else "float32")


def test_weights_still_the_model_reads_the_headers_it_was_registered_with(tmp_path):
    import shutil

    from services.engine_rules import check_weights_still_the_model
    from services.errors import CheckpointChanged
    from services.models.checkpoint import create_checkpoint, read_config

    shape = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    create_checkpoint(tmp_path / "m", **shape)
    config = read_config(tmp_path / "m")
    check_weights_still_the_model("m", tmp_path / "m", config)  # as registered
    check_weights_still_the_model("m", tmp_path / "m", {"model_type": "gpt2"})  # the worker's

    create_checkpoint(tmp_path / "wide", **shape, intermediate_size=256)
    shutil.copyfile(tmp_path / "wide" / "model.safetensors", tmp_path / "m" / "model.safetensors")
    with pytest.raises(
        CheckpointChanged,
        match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[256, 64\] in model\.safetensors",
    ) as err:
        check_weights_still_the_model("m", tmp_path / "m", config)
    assert err.value.reason == "checkpoint_unusable"

    create_checkpoint(tmp_path / "one", **{**shape, "num_layers": 1})
    config_two = read_config(tmp_path / "one") | {"num_hidden_layers": 2}
    with pytest.raises(CheckpointChanged, match=r"tensor 'model\.layers\.1\..*' is missing"):
        check_weights_still_the_model("one", tmp_path / "one", config_two)

    (tmp_path / "one" / "model.safetensors").write_bytes(b"\x08\x00")  # truncated header
    with pytest.raises(CheckpointChanged, match="no longer reads as registered"):
        check_weights_still_the_model("one", tmp_path / "one", config_two)
