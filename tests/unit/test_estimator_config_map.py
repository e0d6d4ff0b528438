"""The configuration map (hash, stored form, caching in Redis) and calibrations."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from estimator_svc import calibration_message as calibrations
from estimator_svc import service as service_module
from estimator_svc.config_map import build_config_map, from_json, source_hash, to_json
from estimator_svc.service import DEFAULT_DEVICES, Estimator
from services.api import common_pb2 as common
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.errors import FailedPrecondition, InvalidArgument, NotFound
from services.estimation.model_references import Workload
from services.importers.maveriq import RTX_A6000_DEVICE_BYTES
from services.state import keys
from services.state.store import StateStore
from tests.unit.estimator_data import tiny_model, tiny_rows

CPU = "cpu-x86_64"


def shipped(hardware_type: str) -> estimator_pb.Calibration:
    message = calibrations.load_shipped(hardware_type)
    assert message is not None
    return message


# ---- pure ------------------------------------------------------------------------------
def test_source_hash_follows_rows_variants_and_calibration():
    model, rows, calibration = tiny_model(), tiny_rows(), shipped(CPU)
    base = source_hash(model, rows, calibration)
    assert base == source_hash(tiny_model(), tiny_rows(), shipped(CPU))
    changed_row = tiny_rows()
    changed_row[0].ttft_ms += 1
    assert source_hash(model, changed_row, calibration) != base
    assert source_hash(model, rows[1:], calibration) != base
    changed_model = tiny_model()
    changed_model.variants[2].accuracy_score = 91.0
    assert source_hash(changed_model, rows, calibration) != base
    refit = estimator_pb.Calibration()
    refit.CopyFrom(calibration)
    refit.extra_terms["tpot.alpha"] = 0.2
    assert source_hash(model, rows, refit) != base


def test_stored_form_round_trips_to_the_same_estimates():
    built = build_config_map(tiny_model(), tiny_rows(), shipped(CPU), CPU, now_ms=7)
    text = to_json(built)
    json.loads(text)  # strict JSON: no NaN tokens
    loaded = from_json(text)
    assert loaded.source_hash == built.source_hash and loaded.built_at_unix_ms == 7
    workload = Workload(output_tokens=50, input_tokens=0, batch_size=2)
    (before, resolved), (after, _) = built.estimate(workload, 4), loaded.estimate(workload, 4)
    assert resolved.input_tokens == 32
    for field in ("latency_s", "ttft_s", "tpot_s", "memory_total_gib", "accuracy_pct"):
        np.testing.assert_array_equal(getattr(before, field), getattr(after, field))


def test_the_stored_form_keeps_how_each_variants_phases_were_measured():
    # Stream-timed rows (the profiler's) and the same rows with end-to-end latency only
    # (as imported): decode_steps composes them differently, so a map read back must know.
    ended = []
    for timed in tiny_rows():
        for output_tokens in (8, 16):
            row = type(timed)()
            row.CopyFrom(timed)
            row.output_tokens = output_tokens
            row.latency_ms = timed.ttft_ms + (output_tokens - 1) * timed.tpot_ms
            row.ttft_ms = row.tpot_ms = row.ttft_layer_ms = row.tpot_layer_ms = 0.0
            ended.append(row)
    for rows, split in ((tiny_rows(), False), (ended, True)):
        built = build_config_map(tiny_model(), rows, shipped(CPU), CPU, now_ms=7)
        loaded = from_json(to_json(built))
        flags = [p.end_to_end_split for pr in loaded.references.prompts for p in pr.profiles]
        assert flags and set(flags) == {split}
        workload = Workload(output_tokens=20, input_tokens=0, batch_size=1)
        estimates, _ = loaded.estimate(workload, 2)
        np.testing.assert_allclose(
            estimates.latency_s, estimates.ttft_s + 19 * estimates.tpot_s, rtol=1e-9
        )


def test_rows_whose_prompt_was_not_recorded_say_so_in_the_notes():
    """Rows of input_tokens 0 alone (MaverIQ's _BS files imported without the others)
    were estimated at any prompt as measured, and at no prompt at all without one given,
    in silence: a note says the prompt was not recorded."""
    unrecorded = tiny_rows()
    for row in unrecorded:
        row.input_tokens = 0
    built = build_config_map(tiny_model(), unrecorded, shipped(CPU), CPU, now_ms=7)
    assert any("prompt length was not recorded" in n for n in built.references.notes)
    recorded = build_config_map(tiny_model(), tiny_rows(), shipped(CPU), CPU, now_ms=7)
    assert not any("not recorded" in n for n in recorded.references.notes)


def test_the_stored_form_keeps_the_whole_shape():
    # An MLP width that 8 does not divide bars tp = 8, and the context bounds the tokens:
    # a map read back from Redis must know both, as the one it was built as did (before,
    # the stored shape lost them and a cached map offered tp = 8).
    model = tiny_model()
    model.shape.intermediate_size = 36
    model.shape.max_position_embeddings = 64
    built = build_config_map(model, tiny_rows(), shipped(CPU), CPU, now_ms=7)
    loaded = from_json(to_json(built))
    assert built.references.shape.mlp_width == 36
    assert built.references.shape.max_positions == 64
    assert loaded.references.shape == built.references.shape
    (before, _), (after, _) = built.estimate(Workload(20), 8), loaded.estimate(Workload(20), 8)
    assert 8 not in set(before.space.tp.tolist())
    np.testing.assert_array_equal(before.space.tp, after.space.tp)
    np.testing.assert_array_equal(before.latency_s, after.latency_s)


def test_a_workload_longer_than_the_context_is_invalid_argument():
    model = tiny_model()
    model.shape.max_position_embeddings = 64
    built = build_config_map(model, tiny_rows(), shipped(CPU), CPU, now_ms=7)
    assert built.estimate(Workload(output_tokens=32), 1)[1].input_tokens == 32  # 64: fits
    # Without a prompt length given, the profiled one when it leaves room for the output,
    # else the room there is (a probe's `iserve estimate M --output-len 64` was refused:
    # the longest profiled prompt, 1,008 tokens, and 64 exceeded 1,024 positions).
    assert built.estimate(Workload(output_tokens=33), 1)[1].input_tokens == 31
    with pytest.raises(
        InvalidArgument,
        match="output_tokens leave no prompt room: a 1-token prompt \\+ output_tokens = 65 "
        "exceeds the model's 64 positions",
    ):
        built.estimate(Workload(output_tokens=64), 1)
    with pytest.raises(InvalidArgument, match="= 70 exceeds the model's 64 positions"):
        built.estimate(Workload(output_tokens=10, input_tokens=60), 1)
    # A shape without a known context (imported rows alone) is not bounded.
    unknown = build_config_map(tiny_model(), tiny_rows(), shipped(CPU), CPU, now_ms=7)
    assert unknown.references.shape.max_positions == 0
    unknown.estimate(Workload(output_tokens=10_000, input_tokens=100_000), 1)


@pytest.mark.parametrize(
    "text", ["not json", "{}", json.dumps({"schema": 999}), json.dumps({"schema": 1})]
)
def test_malformed_or_old_maps_are_rejected(text):
    with pytest.raises(ValueError):
        from_json(text)


def test_calibration_message_round_trips():
    message = shipped("rtx-a6000")
    calibration = calibrations.from_proto(message)
    assert calibration.tp_ladder and calibration.three_refs is not None
    assert calibration.device_memory_bytes == RTX_A6000_DEVICE_BYTES
    assert calibration.primary.memory.tp_peer_gib > 0
    # The A6000 box's own TP ladder (O_TP(tp) / O_TP(2) of decode), stored and read back.
    ratios = dict(calibration.primary.latency.tpot.tp_ratio)
    assert set(ratios) == {4, 8} and 1 < ratios[4] < ratios[8]
    assert dict(calibrations.to_proto(calibration).extra_terms) == pytest.approx(
        dict(message.extra_terms)
    )
    assert message.alpha == pytest.approx(calibration.primary.latency.tpot.alpha)
    assert "fit_default_calibration.py" in message.provenance
    # Decode's growth per further sequence of a batch (the A6000's batch sweep), grown
    # with the tensor degree and the weights' compression.
    growth = {(w, tp): r for w, tp, r in calibration.primary.tpot_batch_growth}
    assert calibration.three_refs.tpot_batch_growth == calibration.primary.tpot_batch_growth
    assert 0 < growth[("fp16", 1)] < growth[("int8", 1)] < growth[("int4", 1)]
    assert growth[("fp16", 1)] < growth[("fp16", 4)] < growth[("fp16", 8)]


def test_per_format_reference_scales_round_trip():
    message = shipped(CPU)
    # A weight format that departs from the float one the same way on every calibration
    # model has factors of its own (as the CPU's int8 kernel had while the layer clock
    # counted each forward's cold first layer): stored and read back.
    for name, value in list(message.extra_terms.items()):
        if name.startswith("scale.") and name.count(".") == 2:
            message.extra_terms[f"{name}.fp16"] = value * 0.98
            message.extra_terms[f"{name}.int8"] = value * 1.03
    calibration = calibrations.from_proto(message)
    scales = calibration.primary.reference_scales
    assert "int8" in {weight for weight, _, _ in scales.by_weight}
    assert any(name.startswith("scale.tpot.1x1.") for name in message.extra_terms)
    assert dict(calibrations.to_proto(calibration).extra_terms) == pytest.approx(
        dict(message.extra_terms)
    )


def test_shipped_cpu_calibration_was_fitted_on_this_testbed():
    message = shipped(CPU)
    assert "bench/estimate_cpu.py" in message.provenance
    assert "full-model runs on cpu-x86_64" in message.provenance
    calibration = calibrations.from_proto(message)
    # Only tp <= 2 was measured: no per-peer memory term, no device size of its own.
    assert calibration.primary.memory.tp_peer_gib == 0
    assert calibration.device_memory_bytes == 0
    scales = calibration.primary.reference_scales
    assert all(0.5 <= s <= 2.0 for s in scales.ttft + scales.tpot)
    assert 0 < message.fit_error_percent < 15


def test_a_calibration_without_phase_terms_applies_its_exponents_to_both_phases():
    message = estimator_pb.Calibration(hardware_type="x", alpha=0.1, beta=0.5, gamma=0.3, delta=1)
    calibration = calibrations.from_proto(message)
    assert calibration.primary.latency.ttft == calibration.primary.latency.tpot
    assert calibration.primary.latency.ttft.delta == 1
    assert calibrations.load_shipped("../calibrations/rtx-a6000") is None
    assert calibrations.load_shipped("no-such-hardware") is None


# ---- against a real redis-server ---------------------------------------------------------
async def put_tiny(store: StateStore, rows=None, model=None) -> None:
    model = model or tiny_model()
    if not await store.create_model(model):
        await store.put_model(model)
    await store.put_profile(
        model_pb.GetProfileResponse(model_id=model.model_id, measurements=rows or tiny_rows())
    )


def test_the_map_is_cached_and_rebuilt_when_its_sources_change(run, monkeypatch):
    builds = []
    real_build = service_module.build_config_map

    def counting_build(*args):
        builds.append(args[3])
        return real_build(*args)

    monkeypatch.setattr(service_module, "build_config_map", counting_build)

    async def scenario(store: StateStore):
        estimator = Estimator(store)
        await put_tiny(store)
        first = await estimator.config_map("tiny", CPU)
        stored = from_json(await store.get_config_map("tiny", CPU))
        assert stored.source_hash == first.source_hash and len(builds) == 1

        assert (await estimator.config_map("tiny", CPU)).source_hash == first.source_hash
        assert len(builds) == 1, "unchanged sources reuse the stored map"

        # Rows of another hardware type leave this map alone.
        await put_tiny(store, tiny_rows() + tiny_rows("rtx-a6000"))
        await estimator.config_map("tiny", CPU)
        assert len(builds) == 1

        # A calibration in Redis replaces the shipped one: rebuilt.
        calibration = estimator_pb.Calibration()
        calibration.CopyFrom(shipped(CPU))
        calibration.extra_terms["tpot.alpha"] = 0.3
        await store.put_calibration(calibration)
        rebuilt = await estimator.config_map("tiny", CPU)
        assert len(builds) == 2 and rebuilt.source_hash != first.source_hash

        # New profile rows of this hardware type, an edited variant: rebuilt.
        await put_tiny(store, tiny_rows()[1:])
        await estimator.config_map("tiny", CPU)
        edited = tiny_model()
        edited.variants[0].accuracy_score = 98.0
        await put_tiny(store, tiny_rows()[1:], edited)
        await estimator.config_map("tiny", CPU)
        assert len(builds) == 4

        # A stored map that no longer parses is rebuilt.
        await store.redis.set(keys.config_map("tiny", CPU), "{broken")
        await estimator.config_map("tiny", CPU)
        assert len(builds) == 5

    run(scenario)


def test_estimates_default_the_devices_and_report_bad_requests(run):
    async def scenario(store: StateStore):
        estimator = Estimator(store)
        await put_tiny(store)
        result = await estimator.estimate("tiny", CPU, Workload(20), 0)
        assert result.devices == DEFAULT_DEVICES
        # tp 1 with pp 1..8, tp 2 with pp 1..4, tp 4 with pp 1, 2, tp 8 with pp 1 (8 is a
        # multiple of the 4 KV heads: each rank holds a replica of its group's KV head).
        assert result.estimates.space.size == 3 * 15

        node = common.NodeState(node_id="n0", agent_address="127.0.0.1:1")
        for i in range(2):
            node.devices.add(
                ref=common.DeviceRef(node_id="n0", device_id=f"cpu{i}"),
                hardware_type=CPU,
                total_bytes=2 << 30,
            )
        await store.register_node(node, ttl_s=30)
        result = await estimator.estimate("tiny", CPU, Workload(20), 0)
        assert result.devices == 2 and result.estimates.space.size == 3 * 3  # (1,1) (1,2) (2,1)
        assert result.estimates.fits.all()

        with pytest.raises(NotFound, match="not registered"):
            await estimator.estimate("nobody", CPU, Workload(20), 0)
        with pytest.raises(FailedPrecondition, match="not profiled on rtx-a6000; profiled on: "):
            await estimator.estimate("tiny", "rtx-a6000", Workload(20), 0)
        await put_tiny(store, tiny_rows("h100"))
        with pytest.raises(FailedPrecondition, match="no calibration for 'h100'"):
            await estimator.estimate("tiny", "h100", Workload(20), 0)
        with pytest.raises(InvalidArgument, match="hardware_type"):
            await estimator.estimate("tiny", "", Workload(20), 0)

    run(scenario)


def test_a_prompt_outside_the_profiled_lengths_says_what_it_stands_on(run):
    async def scenario(store: StateStore):
        estimator = Estimator(store)
        await put_tiny(store)  # profiled with a 32-token prompt only
        profiled = await estimator.estimate("tiny", CPU, Workload(20), 0)
        assert profiled.workload.input_tokens == 32
        assert not any("outside the prompt lengths" in n for n in profiled.notes)
        longer = await estimator.estimate("tiny", CPU, Workload(20, input_tokens=500), 0)
        (note,) = [n for n in longer.notes if "outside the prompt lengths" in n]
        assert note.startswith("a 500-token prompt is outside the prompt lengths profiled (32")
        assert "the 32-token prompt's, not extrapolated" in note
        # The latency is the profiled prompt's; the KV cache is the longer prompt's.
        np.testing.assert_array_equal(longer.estimates.ttft_s, profiled.estimates.ttft_s)
        assert (longer.estimates.memory_total_gib > profiled.estimates.memory_total_gib).all()

    run(scenario)


def test_the_estimates_of_an_incomplete_profile_say_so_first(run):
    """A profile a killed worker left incomplete was said only by `iserve models`; its
    estimates, and the plan that picked a layout it never measured, said nothing."""

    from services.contention import contention_note

    async def scenario(store: StateStore):
        estimator = Estimator(store)
        model = tiny_model()
        model.state = model_pb.MODEL_STATE_PROFILED
        contended = contention_note([0.6, 0.1])
        model.state_reason = (
            "incomplete: 2 profiling job(s) failed because their worker was gone; " + contended
        )
        await put_tiny(store, model=model)
        notes = (await estimator.estimate("tiny", CPU, Workload(20), 0)).notes
        assert notes[0] == (
            "the model's profile is incomplete: 2 profiling job(s) failed because their "
            "worker was gone"
        )  # the contention part, which the reason goes on with, is not said twice
        assert contended and not any(contended in n for n in notes)
        model.state_reason = ""
        await store.put_model(model)
        notes = (await estimator.estimate("tiny", CPU, Workload(20), 0)).notes
        assert not any("incomplete" in n for n in notes)

    run(scenario)


def test_calibration_lookup_and_calibrate(run):
    async def scenario(store: StateStore):
        estimator = Estimator(store)
        assert "bench/estimate_cpu.py" in (await estimator.get_calibration(CPU)).provenance
        with pytest.raises(NotFound, match="no calibration for 'h100'"):
            await estimator.get_calibration("h100")
        with pytest.raises(FailedPrecondition, match="no full-model measurements stored for"):
            await estimator.calibrate(CPU)
        with pytest.raises(NotFound):
            await estimator.calibrate(CPU, ["nobody"])
        await put_tiny(store)
        with pytest.raises(FailedPrecondition, match="no full-model measurements on cpu-x86_64"):
            await estimator.calibrate(CPU, ["tiny"])

        await put_tiny(store, tiny_rows(full_model=True))
        fitted = await estimator.calibrate(CPU)
        assert fitted.provenance.startswith("fitted by Calibrate on 9 full-model runs")
        assert "tiny (9)" in fitted.provenance and "iserve profiling" in fitted.provenance
        assert "only the reference layouts were measured" in fitted.provenance
        assert math.isfinite(fitted.fit_error_percent)
        stored = await estimator.get_calibration(CPU)
        assert stored.provenance == fitted.provenance

    run(scenario)


def test_a_batch_beyond_the_profiled_ones_says_what_it_stands_on(run):
    async def scenario(store: StateStore):
        estimator = Estimator(store)
        await put_tiny(store)
        for batch in (1, 2):
            result = await estimator.estimate("tiny", CPU, Workload(20, batch_size=batch), 0)
            assert not any(
                "extrapolated linearly" in n or "no batch-2" in n for n in result.notes
            ), result.notes
        large = await estimator.estimate("tiny", CPU, Workload(20, batch_size=64), 0)
        (note,) = [n for n in large.notes if n.startswith("batch 64")]
        assert "lower bound" in note or "no batch-2 profile" in note

    run(scenario)
