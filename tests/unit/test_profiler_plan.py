"""Profiling plans without I/O: settings, references, jobs, memory and device choice."""

from __future__ import annotations

import pytest

from fingerprint_svc.profile_plan import (
    ProfileJob,
    ProfilingSettings,
    VariantTarget,
    choose_devices,
    fingerprint_layers,
    no_room_reason,
    plan_jobs,
    variant_targets,
)
from fingerprint_svc.registry import check_variants
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.errors import InvalidArgument
from services.models.arch import ArchSpec
from services.models.families import FAMILIES, ConfigRequest, config_with_layers, parse_config
from services.reservation import RUNTIME_OVERHEAD_BYTES, fingerprint_rank_bytes

MIB = 1 << 20


def _model(layers=6, heads=4, kv_heads=2, intermediate=192, variants=()) -> model_pb.Model:
    return model_pb.Model(
        model_id="m",
        checkpoint_path="m",
        shape=model_pb.ModelShape(
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=16,
            hidden_size=16 * heads,
            intermediate_size=intermediate,
        ),
        variants=list(variants),
    )


def _spec(layers: int, **overrides) -> ArchSpec:
    request = ConfigRequest(
        hidden_size=64,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=None,
        vocab_size=300,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="float32",
        rope_theta=10000.0,
        norm_eps=None,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = {**FAMILIES["llama"].build_config(request), **overrides}
    return parse_config(config_with_layers(config, layers))


def test_settings_from_the_environment():
    assert ProfilingSettings.from_env({}) == ProfilingSettings()
    settings = ProfilingSettings.from_env(
        {
            "ISERVE_PROFILE_OUTPUT_TOKENS": "4, 12",
            "ISERVE_PROFILE_INPUT_TOKENS": "96, 32",
            "ISERVE_PROFILE_WARMUP_RUNS": "0",
            "ISERVE_PROFILE_TIMED_RUNS": "5",
        }
    )
    # Prompts ascend whatever the order given: one worker runs them shortest first.
    assert settings.output_tokens == (4, 12) and settings.input_tokens == (32, 96)
    assert (settings.warmup_runs, settings.timed_runs, settings.max_seq_len) == (0, 5, 108)
    for env, message in [
        ({"ISERVE_PROFILE_OUTPUT_TOKENS": "8,x"}, "comma-separated integers"),
        ({"ISERVE_PROFILE_OUTPUT_TOKENS": "0"}, "at least 1"),
        ({"ISERVE_PROFILE_TIMED_RUNS": "0"}, "at least 1"),
        ({"ISERVE_PROFILE_INPUT_TOKENS": "many"}, "comma-separated integers"),
        ({"ISERVE_PROFILE_INPUT_TOKENS": "64,0"}, "at least 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            ProfilingSettings.from_env(env)


def test_fingerprints_have_pp_and_pp_plus_one_layers():
    assert fingerprint_layers(1, 6) == (1, 2)
    assert fingerprint_layers(2, 6) == (2, 3)
    assert fingerprint_layers(2, 2) == (2,)  # capped: the model itself
    assert fingerprint_layers(2, 1) == ()


def test_plan_on_two_devices_runs_every_reference():
    jobs, skipped = plan_jobs(_model(), ProfilingSettings(), node_devices=2)
    assert skipped == []
    assert [(j.reference, j.num_layers, j.batch_size) for j in jobs[:4]] == [
        ((1, 1), 1, 1),
        ((1, 1), 1, 2),
        ((1, 1), 2, 1),
        ((1, 1), 2, 2),
    ]
    assert {(j.reference, j.num_layers) for j in jobs} == {
        ((1, 1), 1),
        ((1, 1), 2),
        ((1, 2), 2),
        ((1, 2), 3),
        ((2, 1), 1),
        ((2, 1), 2),
    }
    assert len(jobs) == 12 and all(j.variant.name == "base" for j in jobs)


def test_one_device_skips_the_parallel_references_with_the_reason():
    jobs, skipped = plan_jobs(_model(), ProfilingSettings(), node_devices=1)
    assert {j.reference for j in jobs} == {(1, 1)}
    assert skipped == [
        "tp=1 pp=2 (every variant): needs 2 devices on one node; the largest node has 1",
        "tp=2 pp=1 (every variant): needs 2 devices on one node; the largest node has 1",
    ]
    _, skipped = plan_jobs(_model(), ProfilingSettings(), node_devices=0)
    assert all("no live node has devices" in s for s in skipped)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "reason"),
    [
        (3, 3, 192, "tensor_parallel 2 must divide the 3 attention heads"),
        (6, 3, 192, "tensor_parallel 2 must divide the 3 KV heads or be a multiple of them"),
        (4, 2, 191, "tensor_parallel 2 must divide the MLP width 191"),
        (4, 1, 192, None),  # multi-query: the engine replicates the KV head
    ],
)
def test_heads_decide_tensor_parallelism(heads, kv_heads, intermediate, reason):
    model = _model(heads=heads, kv_heads=kv_heads, intermediate=intermediate)
    jobs, skipped = plan_jobs(model, ProfilingSettings(), node_devices=2)
    if reason is None:
        assert skipped == [] and any(j.reference == (2, 1) for j in jobs)
    else:
        assert skipped == [f"tp=2 pp=1 (every variant): {reason}"]


def test_a_one_layer_model_has_no_pipeline_reference():
    jobs, skipped = plan_jobs(_model(layers=1), ProfilingSettings(), node_devices=2)
    assert skipped == [
        "tp=1 pp=2 (every variant): pipeline_parallel must be 1..1 for 1 layers, got 2"
    ]
    assert {j.num_layers for j in jobs} == {1}


def test_variants_follow_the_base_model():
    variants = [
        common.CompressionVariant(
            name="int8",
            weight_quant=common.WEIGHT_QUANT_INT8,
            kv_quant=common.KV_QUANT_NONE,
            pruning=common.PRUNING_NONE,
        ),
        common.CompressionVariant(
            name="pruned",
            weight_quant=common.WEIGHT_QUANT_NONE,
            kv_quant=common.KV_QUANT_NONE,
            pruning=common.PRUNING_STRUCTURED,
            checkpoint_path="m-pruned",
        ),
    ]
    targets = variant_targets(_model(variants=variants))
    assert [(t.name, t.checkpoint_path) for t in targets] == [
        ("base", "m"),
        ("int8", "m"),
        ("pruned", "m-pruned"),
    ]
    jobs, _ = plan_jobs(_model(variants=variants), ProfilingSettings(), node_devices=1)
    assert [j.variant.name for j in jobs] == ["base"] * 4 + ["int8"] * 4 + ["pruned"] * 4
    config = jobs[4].config()
    assert config.variant_name == "int8" and config.weight_quant == common.WEIGHT_QUANT_INT8
    assert jobs[0].config().variant_name == ""  # the base checkpoint
    with pytest.raises(InvalidArgument, match="reserved"):
        check_variants(
            [common.CompressionVariant(name="base", weight_quant=1, kv_quant=1, pruning=1)]
        )


def test_worker_specs_split_stages_evenly():
    job = ProfileJob(VariantTarget("base", "m"), 1, 2, 3, 1)
    assert job.stage_layers == (2, 1)
    specs = job.worker_specs(["cpu1", "cpu0"])
    assert [(s.rank, s.device_id, s.stage, s.first_layer, s.layer_count) for s in specs] == [
        (0, "cpu1", 0, 0, 2),
        (1, "cpu0", 1, 2, 1),
    ]
    tp = ProfileJob(VariantTarget("base", "m"), 2, 1, 2, 2).worker_specs(["cpu0", "cpu1"])
    assert [(s.rank, s.tensor_rank, s.layer_count) for s in tp] == [(0, 0, 2), (1, 1, 2)]
    assert job.describe() == "base fingerprint(3 layers) tp=1 pp=2 batch=1"


def rank_memory_bytes(spec, job: ProfileJob, max_seq_len: int, compute: int) -> list[int]:
    return fingerprint_rank_bytes(
        spec,
        tensor_parallel=job.tensor_parallel,
        stage_layers=job.stage_layers,
        batch_size=job.batch_size,
        max_seq_len=max_seq_len,
        compute_bytes=compute,
    )


def test_rank_memory_covers_weights_cache_and_runtime():
    spec = _spec(2)
    single = rank_memory_bytes(spec, ProfileJob(VariantTarget("base", "m"), 1, 1, 2, 1), 80, 4)
    weights = spec.weight_bytes(4)
    assert len(single) == 1 and single[0] > weights + RUNTIME_OVERHEAD_BYTES
    assert single[0] < weights + RUNTIME_OVERHEAD_BYTES + 2 * MIB
    batch2 = rank_memory_bytes(spec, ProfileJob(VariantTarget("base", "m"), 1, 1, 2, 2), 80, 4)
    assert batch2[0] > single[0]
    tp = rank_memory_bytes(spec, ProfileJob(VariantTarget("base", "m"), 2, 1, 2, 1), 80, 4)
    assert len(tp) == 2 and tp[0] == tp[1] < single[0]
    pp = rank_memory_bytes(_spec(3), ProfileJob(VariantTarget("base", "m"), 1, 2, 3, 1), 80, 4)
    assert len(pp) == 2 and all(n > RUNTIME_OVERHEAD_BYTES for n in pp)


def _device(device_id: str, free_mib: int, load: float = 0.0) -> common.DeviceState:
    return common.DeviceState(
        ref=common.DeviceRef(node_id="n0", device_id=device_id),
        free_bytes=free_mib * MIB,
        load=load,
        hardware_type="cpu-x86_64",
    )


def _node(*devices, node_id="n0", alive=True) -> common.NodeState:
    for d in devices:
        d.ref.node_id = node_id
    return common.NodeState(
        node_id=node_id, agent_address=f"{node_id}:1", alive=alive, devices=devices
    )


def test_devices_idle_first_then_most_free():
    nodes = [_node(_device("cpu0", 900, load=0.5), _device("cpu1", 700), _device("cpu2", 800))]
    assert choose_devices(nodes, [600 * MIB]).device_ids == ["cpu2"]
    assert choose_devices(nodes, [600 * MIB, 600 * MIB]).device_ids == ["cpu2", "cpu1"]
    assert choose_devices(nodes, [750 * MIB]).device_ids == ["cpu2"]
    assert choose_devices(nodes, [850 * MIB]).device_ids == ["cpu0"]


def test_a_job_stays_on_one_live_node():
    nodes = [
        _node(_device("cpu0", 900), node_id="a"),
        _node(_device("cpu0", 900), _device("cpu1", 900), node_id="b"),
        _node(_device("cpu0", 5000), _device("cpu1", 5000), node_id="dead", alive=False),
    ]
    choice = choose_devices(nodes, [600 * MIB, 600 * MIB])
    assert choice.node_id == "b" and choice.agent_address == "b:1"
    assert choose_devices(nodes, [600 * MIB] * 3) is None


def test_no_room_names_the_largest_free_device():
    nodes = [_node(_device("cpu0", 100), _device("cpu1", 300))]
    assert choose_devices(nodes, [600 * MIB]) is None
    assert no_room_reason(nodes, [600 * MIB]) == (
        "no device has 600 MiB free (largest free: 300 MiB on n0/cpu1)"
    )
    assert no_room_reason(nodes, [600 * MIB] * 2).startswith("no node has 2 devices with 600 MiB")
    assert no_room_reason([], [1]) == "no live node agent has devices"


def test_no_room_on_virtual_devices_too_small_says_how_to_size_them():
    # A 70B model's one-layer fingerprint needs 5.8 GiB; virtual devices default to 4.
    small = [_device("cpu0", 4096), _device("cpu1", 2048)]
    for device in small:
        device.kind, device.total_bytes = common.DEVICE_KIND_CPU_VIRTUAL, 4096 * MIB
    reason = no_room_reason([_node(*small)], [5815 * MIB])
    assert reason.startswith("no device has 5815 MiB free (largest free: 4096 MiB on n0/cpu0)")
    assert reason.endswith(
        "as large as `iserve up --device-memory GIB` (ISERVE_DEVICE_MEMORY_GIB) makes them"
    )
    # Large enough but busy: waiting helps, and the hint would mislead.
    assert "device-memory" not in no_room_reason([_node(*small)], [3000 * MIB, 3000 * MIB])


def test_a_variant_whose_compression_a_tensor_rank_cannot_take_is_not_launched_there():
    """MLP 360: int4's groups of 8 divide it whole but not a tp = 2 rank's 180, so int4
    is profiled at (1,1) and (1,2) and skipped at (2,1), saying why; the probe saw its
    workers launched there, reading the checkpoint, only to exit."""
    int4 = common.CompressionVariant(name="int4", weight_quant=common.WEIGHT_QUANT_INT4)
    model = _model(intermediate=360, variants=[int4])
    jobs, skipped = plan_jobs(model, ProfilingSettings(), node_devices=2)
    layouts = {(j.variant.name, j.tensor_parallel, j.pipeline_parallel) for j in jobs}
    assert ("int4", 1, 1) in layouts and ("int4", 1, 2) in layouts
    assert ("int4", 2, 1) not in layouts and ("base", 2, 1) in layouts
    assert skipped == [
        "variant int4: tp=2 pp=1: int4 weight quantization needs every projection's input "
        "width divisible by 8; the MLP width on each of 2 tensor ranks is 180"
    ]
