"""deploy_svc.planning: walking ranked options to one placed decision (pure logic)."""

from __future__ import annotations

import dataclasses

import pytest

from deploy_svc import planning
from deploy_svc.explicit import ExplicitPlan
from deploy_svc.placement import Candidate
from deploy_svc.planning import Option, decide, policy_name
from services.api import common_pb2 as common
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.errors import InvalidArgument, ResourceExhausted
from services.reservation import RUNTIME_OVERHEAD_BYTES, memory_blocks, prefill_activation_bytes
from services.simulation import MAX_SIMULATED_DEVICES, simulated_devices

GIB = 1 << 30
LIMITS = ExplicitPlan(common.DeploymentConfig(batch_size=1), 64, 64)


def model() -> model_pb.Model:
    m = model_pb.Model(
        model_id="m",
        checkpoint_path="m",
        shape=model_pb.ModelShape(
            num_layers=8,
            num_attention_heads=8,
            num_kv_heads=8,
            head_dim=64,
            hidden_size=512,
            intermediate_size=1024,
            vocab_size=1000,
            max_position_embeddings=2048,
            parameter_count=8 * 3_000_000 + 2 * 512_000,
            weight_bytes=4 * (8 * 3_000_000 + 2 * 512_000),
            dtype=common.PRECISION_FLOAT32,
        ),
    )
    m.variants.add(name="fp32", weight_quant=common.WEIGHT_QUANT_NONE)
    m.variants.add(name="gptq", weight_quant=common.WEIGHT_QUANT_GPTQ_INT4)
    return m


def option(rank, tp=1, pp=1, variant="fp32", memory_total=0, meets=True) -> Option:
    config = common.DeploymentConfig(
        tensor_parallel=tp, pipeline_parallel=pp, variant_name=variant, batch_size=1
    )
    estimate = estimator_pb.ConfigEstimate(config=config, memory_total_bytes=memory_total)
    return Option(rank, config, estimate, meets)


def devices(*free_gib: float, load: float = 0.0) -> list[Candidate]:
    return [Candidate("n", f"cpu{i}", int(f * GIB), load) for i, f in enumerate(free_gib)]


def test_the_first_option_that_fits_wins_and_the_skipped_ones_say_why():
    options = [
        option(1, variant="gptq"),
        option(2, tp=4),
        option(3, memory_total=100 * GIB),
        option(4, pp=2),
    ]
    decision = decide(model(), options, devices(2, 2), LIMITS, note="ranked")
    assert decision.winner_rank == 4
    assert (decision.config.tensor_parallel, decision.config.pipeline_parallel) == (1, 2)
    reasons = [s.reason for s in decision.skipped]
    assert [s.rank for s in decision.skipped] == [1, 2, 3]
    assert reasons[0].startswith("the engine cannot run it") and "GPTQ" in reasons[0]
    assert reasons[1].startswith("no room") and "needs 4 devices" in reasons[1]
    assert reasons[2].startswith("no room")
    assert decision.note == "ranked"
    stages = decision.placement.stages
    assert [(s.first_layer, s.layer_count) for s in stages] == [(0, 4), (4, 4)]
    assert decision.estimate.config.pipeline_parallel == 2


def test_excluded_ranks_are_skipped_with_their_reason_and_fallbacks_are_noted():
    options = [option(1), option(2, pp=2, meets=False)]
    decision = decide(model(), options, devices(2, 2), LIMITS, excluded={1: "launch failed: x"})
    assert decision.winner_rank == 2
    assert decision.skipped[0].reason == "launch failed: x"
    assert decision.note == "configuration #2 is a fallback: it does not meet the intent"
    # With the estimator's shortfall, the note names what is missed.
    options[1] = dataclasses.replace(
        options[1], shortfall="its accuracy 90 is under the floor of 95"
    )
    decision = decide(model(), options, devices(2, 2), LIMITS, excluded={1: "launch failed: x"})
    assert decision.note == (
        "configuration #2 is a fallback: its accuracy 90 is under the floor of 95"
    )


def test_a_choice_whose_communication_was_never_profiled_says_so():
    measured, unprofiled = option(1, pp=2), option(1, pp=2)
    unprofiled.estimate.communication_unprofiled = True
    assert decide(model(), [measured], devices(2, 2), LIMITS).note == ""
    note = decide(model(), [unprofiled], devices(2, 2), LIMITS).note
    assert note.startswith("configuration #1 splits the model a way its fingerprints never ran")
    assert "it will run slower than estimated" in note


@pytest.mark.parametrize(
    ("stored", "cuda", "asked", "profiled_in"),
    [
        (common.PRECISION_BFLOAT16, False, common.PRECISION_BFLOAT16, "float32"),
        (common.PRECISION_FLOAT32, False, common.PRECISION_BFLOAT16, "float32"),
        (common.PRECISION_BFLOAT16, True, common.PRECISION_FLOAT32, "bfloat16"),
        (common.PRECISION_BFLOAT16, False, common.PRECISION_FLOAT32, ""),
        (common.PRECISION_BFLOAT16, True, common.PRECISION_BFLOAT16, ""),
        (common.PRECISION_BFLOAT16, False, common.PRECISION_UNSPECIFIED, ""),
    ],
)
def test_a_dtype_the_profiles_never_computed_in_gets_no_estimate(stored, cuda, asked, profiled_in):
    m = model()
    m.shape.dtype = stored
    prepared = planning.Prepared(m, LIMITS, "hybrid", cuda, [], None, "", [], None, True)
    if profiled_in:  # never profiled: it has no profile, in any dtype
        note = planning.unprofiled_dtype(prepared, common.DeploymentConfig(dtype=asked))
        assert note == "no estimate: m has no profile"
    m.state = model_pb.MODEL_STATE_PROFILED
    note = planning.unprofiled_dtype(prepared, common.DeploymentConfig(dtype=asked))
    if profiled_in:
        asked_name = common.Precision.Name(asked).removeprefix("PRECISION_").lower()
        assert note == (
            f"no estimate: m was profiled in {profiled_in}, this deployment computes in "
            f"{asked_name}"
        )
    else:
        assert note == ""


def test_memory_blocks_take_the_larger_of_estimate_and_shape():
    m = model()
    config = common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=1, batch_size=1)
    fixed, block = memory_blocks(m.shape, config, 128)
    # Fixed: the runtime, the embedding and LM head, whole on each tensor rank, and the
    # longest prefill's activations.
    prefill = prefill_activation_bytes(m.shape, config, 128)
    assert fixed == RUNTIME_OVERHEAD_BYTES + 2 * 512_000 * 4 + prefill and block > 0
    _, bigger = memory_blocks(m.shape, config, 128, 64 * GIB)
    # The estimate covers whole ranks: a rank of an even split reserves the estimator's
    # figure per device (fixed was counted on top of it, twice).
    layers = m.shape.num_layers
    assert fixed + layers * bigger == pytest.approx(64 * GIB / 2, abs=layers)
    for pp in (2, 4):
        staged = common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=pp, batch_size=1)
        fixed, block = memory_blocks(m.shape, staged, 128, 64 * GIB)
        assert fixed + layers // pp * block == pytest.approx(64 * GIB / (2 * pp), abs=layers)
    # An estimate below what the shape says changes nothing.
    assert memory_blocks(m.shape, config, 128, 1) == memory_blocks(m.shape, config, 128)


def test_uneven_maps_are_explained():
    # The first device holds about one layer besides its fixed overhead.
    m = model()
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2, batch_size=1)
    fixed, block = memory_blocks(m.shape, config, LIMITS.max_seq_len)
    free = [(fixed + block * 3 // 2) / GIB, 4.0]
    decision = decide(m, [option(1, pp=2)], devices(*free), LIMITS)
    assert [s.layer_count for s in decision.placement.stages] == [1, 7]
    assert "uneven layer map 1+7" in decision.note


def test_nothing_placeable_is_resource_exhausted_listing_reasons():
    options = [option(r, tp=8) for r in range(1, 8)]
    with pytest.raises(ResourceExhausted) as err:
        decide(model(), options, devices(1, 1), LIMITS)
    assert "#1 tp=8 pp=1" in str(err.value) and "and 2 more" in str(err.value)


def test_a_refusal_says_how_many_configurations_the_ranking_left_out_for_memory():
    """A refusal listed the configurations it tried, and read as if tp=1 pp=1, ranked out
    because its KV cache could never fit a device, had not been considered."""
    from services.estimation.score import unfit_note

    options = [option(1, tp=8)]
    for count, words in (
        (3, "3 configurations do not fit the device memory"),
        (1, "1 configuration does not fit the device memory"),
    ):
        assert unfit_note(count) == words
        note = f"ranked for cpu (2 devices); {words}; batch 1"
        with pytest.raises(ResourceExhausted) as err:
            decide(model(), options, devices(1, 1), LIMITS, note=note)
        assert str(err.value).endswith(f"; {words}, ranked out"), err.value
    with pytest.raises(ResourceExhausted) as err:
        decide(model(), options, devices(1, 1), LIMITS, note="ranked for cpu (2 devices)")
    assert "ranked out" not in str(err.value)


def test_policy_names():
    assert policy_name(common.PLACEMENT_POLICY_UNSPECIFIED) == "hybrid"
    assert policy_name(common.PLACEMENT_POLICY_LEAST_LOADED) == "least-loaded"
    with pytest.raises(ValueError):
        policy_name(17)


def _node(node_id: str, *devices: tuple[str, int], alive: bool = True) -> common.NodeState:
    return common.NodeState(
        node_id=node_id,
        alive=alive,
        devices=[
            common.DeviceState(
                ref=common.DeviceRef(node_id=node_id, device_id=f"d{i}"),
                hardware_type=hardware,
                kind=kind,
                total_bytes=GIB,
                free_bytes=GIB,
            )
            for i, (hardware, kind) in enumerate(devices)
        ],
    )


def test_an_intent_is_ranked_for_the_hardware_type_with_most_live_devices():
    cpu, cuda = ("cpu-x86_64", common.DEVICE_KIND_CPU_VIRTUAL), ("h100", common.DEVICE_KIND_CUDA)
    nodes = [
        _node("a", cpu, cpu),
        _node("b", cuda, cuda, cuda),
        _node("c", cuda, cuda, cuda, alive=False),  # dead: counts for nothing
    ]
    assert planning.hardware_order(nodes) == [("h100", 3), ("cpu-x86_64", 2)]
    assert planning.on_cuda(nodes) and not planning.on_cuda(nodes[:1])
    assert {c.hardware_type for c in planning.candidates_for(nodes, "cpu-x86_64")} == {"cpu-x86_64"}
    assert len(planning.candidates_for(nodes, None)) == 5  # an explicit configuration
    assert planning.hardware_order([nodes[2]]) == []


def test_simulated_devices_are_bounded_on_both_sides_of_the_wire():
    # The CLI builds them (iserve plan --devices N) and PlanDeployment reads them: 4096 at
    # most, so that a request's planning stays bounded (4294967295 hung the CLI before).
    devices = simulated_devices("rtx-a6000", MAX_SIMULATED_DEVICES, 48)
    (node,) = planning.simulated_nodes(devices)
    assert len(node.devices) == MAX_SIMULATED_DEVICES
    with pytest.raises(InvalidArgument, match="at most 4096 simulated devices, got 4097"):
        planning.simulated_nodes(
            [*devices, common.DeviceState(ref=common.DeviceRef(device_id="x"))]
        )
    for count in (0, MAX_SIMULATED_DEVICES + 1):
        with pytest.raises(ValueError, match="simulated devices must number 1 to 4096"):
            simulated_devices("rtx-a6000", count, 48)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"ref": common.DeviceRef(node_id="n" * 1_000_000, device_id="d0")},
            "invalid node_id 'nnn",
        ),
        ({"ref": common.DeviceRef(device_id="d" * 1_000_000)}, "invalid device_id 'ddd"),
        ({"ref": common.DeviceRef(device_id="gpu 0")}, "invalid device_id 'gpu 0'"),
        ({"hardware_type": "RTX A6000\n"}, "invalid hardware_type"),
        ({"free_bytes": 2 * GIB}, "free_bytes 2147483648 exceeds total_bytes 1073741824"),
        ({"used_bytes": 2 * GIB}, "used_bytes 2147483648 exceeds total_bytes"),
        ({"reserved_bytes": 2 * GIB}, "reserved_bytes 2147483648 exceeds total_bytes"),
        ({"kind": 999}, "kind 999 is not a DeviceKind"),
        # It planned batch 1 on "no estimate of this configuration's TPOT" (a tester).
        ({"total_bytes": 2**64 - 1}, "total_bytes 18446744073709551615 is over .* .1 PiB."),
        (
            {"used_bytes": GIB, "reserved_bytes": GIB, "free_bytes": GIB},
            r"free_bytes 1073741824 exceeds what used_bytes and reserved_bytes leave .* \(0\)",
        ),
    ],
)
def test_a_simulated_device_is_checked_as_an_agents_would_be(changes, message):
    """A fuzzing tester's simulated devices went unchecked: a megabyte node id came back
    whole in the message (a transport error at the client), and free bytes above the
    total were planned on."""
    device = common.DeviceState(
        ref=common.DeviceRef(device_id="d0"), hardware_type="rtx-a6000", total_bytes=GIB
    )
    for name, value in changes.items():
        if name == "ref":
            device.ref.CopyFrom(value)
        else:
            setattr(device, name, value)
    with pytest.raises(InvalidArgument, match=message) as refused:
        planning.simulated_nodes([device])
    assert len(str(refused.value)) < 300


def test_a_decision_s_memory_figures_share_one_basis():
    """With an estimate, both memory figures are the estimator's (the engine's alone);
    without one, both are the placement's reservations. The per-device figure used to be
    raised to the reservation while the total stayed the estimate: a total ten times
    below one device's figure (a probe)."""
    ranked = option(1, pp=2, memory_total=50_000_000)
    ranked.estimate.memory_per_device_bytes = 25_000_000
    decision = decide(model(), [ranked], devices(2, 2), LIMITS)
    assert decision.estimate.memory_total_bytes == 50_000_000
    assert decision.estimate.memory_per_device_bytes == 25_000_000
    explicit = Option(1, ranked.config, None, True)
    decision = decide(model(), [explicit], devices(2, 2), LIMITS)
    reserved = [b for s in decision.placement.stages for b in s.reserved_bytes]
    assert decision.estimate.memory_total_bytes == sum(reserved)
    assert decision.estimate.memory_per_device_bytes == max(reserved)


def _explicit(config: common.DeploymentConfig, free_gib: float) -> tuple:
    """An explicit configuration's prepared request and its decision on two CPU devices
    with ``free_gib`` free each."""
    cpu = ("cpu-x86_64", common.DEVICE_KIND_CPU_VIRTUAL)
    node = _node("n", cpu, cpu)
    for device in node.devices:
        device.total_bytes = device.free_bytes = int(free_gib * GIB)
    prepared = planning.Prepared(
        model=model(),
        limits=ExplicitPlan(config, 64, 64),
        policy=policy_name(0),
        cuda=False,
        options=[Option(1, config, None, True)],
        hardware_type=None,
        note="explicit configuration",
        nodes=[node],
        objectives=common.ServiceObjectives(),
        auto_batch=False,
    )
    return prepared, [node], planning.decide_on(prepared, [node])


def _estimates(config: common.DeploymentConfig, per_device: int) -> tuple:
    batch1 = estimator_pb.ConfigEstimate(
        config=config,
        ttft_ms=10.0,
        tpot_ms=2.0,
        latency_ms=40.0,
        memory_total_bytes=2 * per_device,
        memory_per_device_bytes=per_device,
        kv_cache_bytes=1 << 20,
    )
    batch2 = estimator_pb.ConfigEstimate(
        config=config, ttft_ms=12.0, tpot_ms=2.5, latency_ms=49.5, batch_measured=True
    )
    return batch1, batch2


def test_an_explicit_configuration_gets_the_estimate_of_its_batch_and_reserves_it():
    """An explicit configuration (ranked by nothing) at batch 1, or at a batch it gave,
    showed no estimate although its model was profiled, and its ranks reserved the
    shape's figure even where the estimate was larger (a probe: 4.2 GiB reserved, 4.9
    estimated a device)."""
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2, batch_size=1)
    prepared, nodes, decision = _explicit(config, free_gib=4)
    assert not decision.estimate.latency_ms
    shape_reserved = max(b for st in decision.placement.stages for b in st.reserved_bytes)
    batch1, batch2 = _estimates(config, per_device=shape_reserved + (200 << 20))
    at_one = planning.with_estimate(prepared, decision, nodes, batch1, batch2)
    assert (at_one.estimate.latency_ms, at_one.estimate.tpot_ms) == (40.0, 2.0)
    assert at_one.estimate.memory_per_device_bytes == batch1.memory_per_device_bytes
    assert at_one.estimate.config == at_one.config and at_one.config.pipeline_parallel == 2
    reserved = [b for st in at_one.placement.stages for b in st.reserved_bytes]
    assert min(reserved) >= batch1.memory_per_device_bytes > shape_reserved
    assert at_one.note == "explicit configuration"
    # At a batch the request gave: Eq. 6 from the batch-1 and batch-2 estimates.
    config4 = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2, batch_size=4)
    prepared4, nodes, decision4 = _explicit(config4, free_gib=4)
    at_four = planning.with_estimate(prepared4, decision4, nodes, *_estimates(config4, 1 << 20))
    assert at_four.estimate.tpot_ms == pytest.approx(2.0 + 3 * 0.5)
    assert at_four.estimate.config.batch_size == 4
    # Unknown at that batch (no batch-2 profile), or already estimated: unchanged.
    assert planning.with_estimate(prepared4, decision4, nodes, batch1, None) == decision4
    assert planning.with_estimate(prepared, at_one, nodes, batch2, batch2) == at_one


def test_an_explicit_configuration_whose_estimate_does_not_fit_keeps_its_shape_s_room():
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2, batch_size=1)
    prepared, nodes, decision = _explicit(config, free_gib=1)
    batch1, batch2 = _estimates(config, per_device=3 * GIB)
    out = planning.with_estimate(prepared, decision, nodes, batch1, batch2)
    assert out.placement == decision.placement and out.estimate.latency_ms == 40.0
    assert "its estimate (3.00 GiB a device) does not fit its devices' free memory" in out.note
