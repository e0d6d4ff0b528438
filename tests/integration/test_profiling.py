"""Registration profiles fingerprints on the real stack; bad cases end FAILED, hold
nothing and can be registered again."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import grpc
import pytest

from fingerprint_svc.fingerprints import FINGERPRINTS_DIR, content_hash
from monitor_agent.engine.layer_clock import clocked_layers
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.reservation import layer_kv_bytes_per_token, layer_weight_bytes
from tests.integration.helpers import (
    TINY,
    make_checkpoint,
    reserved_by_device,
    rid,
    settled_devices,
    wait_for,
)

pytestmark = pytest.mark.integration

MIB = 1 << 20
PROFILED_SHAPE = {"hidden_size": 64, "num_layers": 6, "num_heads": 4, "num_kv_heads": 2}
WATCH_TIMEOUT_S = 900


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _register(stack, model_id: str, checkpoint: str, **fields) -> model_pb.Model:
    return stack.models.RegisterModel(
        model_pb.RegisterModelRequest(
            request_id=rid(), model_id=model_id, checkpoint_path=checkpoint, **fields
        )
    ).model


def _watch(stack, model_id: str) -> list[model_pb.WatchModelResponse]:
    return list(
        stack.models.WatchModel(
            model_pb.WatchModelRequest(request_id=rid(), model_id=model_id),
            timeout=WATCH_TIMEOUT_S,
        )
    )


def _profile_owners(stack) -> set[str]:
    async def owners():
        store = stack.store()
        try:
            return {o for o in await store.reservation_owners() if o.startswith("profile-")}
        finally:
            await store.close()

    return asyncio.run(owners())


def _free_bytes(stack) -> list[int]:
    cluster = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    return [d.free_bytes for n in cluster.nodes for d in n.devices]


def _cli(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        env={**os.environ, **stack.env},
        capture_output=True,
        text=True,
        timeout=WATCH_TIMEOUT_S,
    )


def _profile_workers(stack) -> list[agent_pb.WorkerInfo]:
    workers = stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    return [w for w in workers if w.deployment_id.startswith("profile-")]


def _delete(stack, model_id: str) -> None:
    stack.models.DeleteModel(model_pb.DeleteModelRequest(request_id=rid(), model_id=model_id))


def test_register_profiles_the_fingerprints(stack):
    before = reserved_by_device(stack)
    path = make_checkpoint(stack, "prof-llama", **PROFILED_SHAPE)
    model = _register(stack, "prof-llama", path)
    assert model.state == model_pb.MODEL_STATE_PROFILING

    events = _watch(stack, "prof-llama")
    last = events[-1]
    assert last.state == model_pb.MODEL_STATE_PROFILED, last
    assert 0 < last.runs_done == last.runs_total
    done = [e.runs_done for e in events]
    assert done == sorted(done)
    assert all(e.state == model_pb.MODEL_STATE_PROFILING for e in events[:-1])

    profile = stack.models.GetProfile(
        model_pb.GetProfileRequest(request_id="p1", model_id="prof-llama")
    )
    assert profile.request_id == "p1" and profile.model_id == "prof-llama"
    cluster = stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest())
    hardware = {d.hardware_type for n in cluster.nodes for d in n.devices}
    single = [
        m
        for m in profile.measurements
        if (m.config.tensor_parallel, m.config.pipeline_parallel) == (1, 1)
    ]
    # Three prompt lengths, so that another prompt's TTFT follows a measured curve.
    assert {
        (m.num_layers, m.config.batch_size, m.input_tokens, m.output_tokens) for m in single
    } == {(n, b, p, o) for n in (1, 2) for b in (1, 2) for p in (64, 256, 1024) for o in (8, 16)}
    for m in profile.measurements:
        assert m.variant_name == "base" and not m.full_model
        assert m.repetitions == 3 and m.hardware_type in hardware
        assert m.ttft_ms > 0 and m.tpot_ms > 0 and m.latency_ms > m.ttft_ms
        # The workers' layer clock: one layer's time inside the run. The layers it timed
        # on rank 0 fit inside the request: the prefill before the first token, every
        # decode step before the last. (Not below the stream's TPOT: a tiny model's
        # tokens can reach the agent in bursts, which makes the gaps between arrivals
        # shorter than a step.) Only the timed ones: a stage's first layer is not, and
        # a timed layer a busy core slowed, counted for every layer of the stage, passed
        # the TTFT (a CI run under load: 2 x 9.10 ms against 18.13 ms).
        assert m.ttft_layer_ms > 0 and m.tpot_layer_ms > 0
        timed = clocked_layers(m.stage_layers[0] if m.stage_layers else m.num_layers)
        assert timed * m.ttft_layer_ms < m.ttft_ms
        decode_ms = timed * m.tpot_layer_ms * (m.output_tokens - 1)
        assert timed * m.ttft_layer_ms + decode_ms < m.latency_ms
        ranks = m.config.tensor_parallel * m.config.pipeline_parallel
        assert len(m.peak_memory_bytes_per_rank) == ranks
        assert all(peak > 0 for peak in m.peak_memory_bytes_per_rank)
        assert sum(m.stage_layers) == m.num_layers
        # What a layer holds is known, not measured: the engine's formats on the shape.
        assert (
            m.layer_weight_bytes == pytest.approx(layer_weight_bytes(model.shape, m.config))
            and m.layer_weight_bytes > 0
        )
        assert (
            m.layer_kv_bytes_per_token
            == pytest.approx(layer_kv_bytes_per_token(model.shape, m.config))
            and m.layer_kv_bytes_per_token > 0
        )
    # Each multi-device reference was either measured or skipped with the reason.
    for tp, pp in [(1, 2), (2, 1)]:
        measured = any(
            (m.config.tensor_parallel, m.config.pipeline_parallel) == (tp, pp)
            for m in profile.measurements
        )
        reasons = [s for s in profile.skipped if f"tp={tp} pp={pp}" in s]
        assert measured or reasons, (tp, pp, list(profile.skipped))
    # A tensor-parallel layout's two ranks hold equal shards and run the same steps,
    # and the follower measures its memory as rank 0 does: their figures agree. (Its RSS
    # growth, counted before, read about twice rank 0's figure.)
    for m in profile.measurements:
        if (m.config.tensor_parallel, m.config.pipeline_parallel) == (2, 1):
            rank0, rank1 = m.peak_memory_bytes_per_rank
            assert 0.8 < rank1 / rank0 < 1.25, (m.num_layers, m.input_tokens, rank0, rank1)
    cost = profile.cost
    assert cost.wall_time_ms > 0 and cost.device_seconds > 0 and cost.peak_device_memory_bytes > 0
    print(
        f"\nprofiling cost of a 6-layer hidden-64 model: {cost.wall_time_ms / 1e3:.1f} s wall, "
        f"{cost.device_seconds:.1f} device-seconds, peak {cost.peak_device_memory_bytes / MIB:.1f} "
        f"MiB; {len(profile.measurements)} measurements; skipped: {list(profile.skipped)}"
    )

    # The CLI shows the same profile: its cost, every measurement, the layer clock.
    shown = _cli(stack, "profile", "show", "prof-llama")
    assert shown.returncode == 0, shown.stderr
    assert f"{len(profile.measurements)} fingerprint and 0 full-model measurements" in shown.stdout
    assert f"{cost.device_seconds:.1f} device-s" in shown.stdout
    rows = [line for line in shown.stdout.splitlines() if line.startswith("base ")]
    assert len(rows) == len(profile.measurements)
    assert all("/" in row for row in rows)  # "prefill/decode" layer ms: the clock ran
    as_json = json.loads(_cli(stack, "profile", "show", "prof-llama", "--json").stdout)
    assert len(as_json["measurements"]) == len(profile.measurements)

    # On these CPU devices the fingerprints' layers were timed among copies that give a
    # forward the full model's cache footprint: its 6 layers at pp = 1, 3 a stage at pp = 2.
    logs = [
        p.read_text(errors="replace")
        for p in (stack.settings.state_dir / "logs").glob("worker-profile-*.log*")
    ]
    for stage in ("6-layer", "3-layer"):
        assert any(f"for the full model's {stage} stage" in text for text in logs), stage

    key = content_hash(stack.models_root / path)
    for layers in (1, 2):
        assert (stack.models_root / FINGERPRINTS_DIR / key / f"L{layers}" / "config.json").is_file()
    assert _profile_owners(stack) == set() and _profile_workers(stack) == []
    assert reserved_by_device(stack) == before
    _delete(stack, "prof-llama")
    # Its fingerprints go with it (GBs for a large model); its checkpoint stays.
    assert not (stack.models_root / FINGERPRINTS_DIR / key).exists()
    assert (stack.models_root / path / "config.json").is_file()


def test_deleting_a_model_stops_its_profiling(stack):
    path = make_checkpoint(stack, "prof-deleted", **TINY)
    out = _cli(stack, "register", "prof-deleted", path, "--no-wait")
    assert out.returncode == 0 and "(PROFILING)" in out.stdout, out
    assert wait_for(lambda: _profile_workers(stack) != [], timeout=60)  # a job is running
    deleted = _cli(stack, "model", "delete", "prof-deleted")
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.startswith("deleted prof-deleted (its record, profiles and the ")
    assert wait_for(lambda: _profile_workers(stack) == [], timeout=30)
    assert _profile_owners(stack) == set()
    # A cut still under way when the job was cancelled removes what it made.
    content = stack.models_root / FINGERPRINTS_DIR / content_hash(stack.models_root / path)
    assert wait_for(lambda: not content.exists(), timeout=30)
    code, _ = _code(lambda: _watch(stack, "prof-deleted"))
    assert code == grpc.StatusCode.NOT_FOUND


def test_profiling_without_room_fails_and_holds_nothing(stack):
    path = make_checkpoint(stack, "prof-noroom", **TINY)
    # Sized from a state published after earlier jobs' workers stopped (see settled_devices).
    hog = {
        (d.ref.node_id, d.ref.device_id): max(0, d.free_bytes - 64 * MIB)
        for d in settled_devices(stack)
    }

    async def reserve(release: bool):
        store = stack.store()
        try:
            await (store.release("test-hog") if release else store.reserve("test-hog", hog))
        finally:
            await store.close()

    asyncio.run(reserve(release=False))
    try:
        assert all(free < 512 * MIB for free in _free_bytes(stack))
        _register(stack, "prof-noroom", path)
        last = _watch(stack, "prof-noroom")[-1]
    finally:
        asyncio.run(reserve(release=True))
    assert last.state == model_pb.MODEL_STATE_FAILED
    model = stack.models.GetModel(model_pb.GetModelRequest(model_id="prof-noroom")).model
    assert model.state == model_pb.MODEL_STATE_FAILED and model.state_reason == last.message
    assert model.state_reason.startswith("base fingerprint(1 layer) tp=1 pp=1 batch=1: ")
    assert "no device has" in model.state_reason and "MiB free" in model.state_reason
    assert _profile_owners(stack) == set()
    code, details = _code(
        lambda: stack.models.GetProfile(model_pb.GetProfileRequest(model_id="prof-noroom"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not profiled yet" in details

    # A FAILED model is registered again (here without profiling) rather than refused.
    retried = _register(stack, "prof-noroom", path, skip_profiling=True)
    assert retried.state == model_pb.MODEL_STATE_REGISTERED and retried.state_reason == ""
    [event] = _watch(stack, "prof-noroom")
    assert (event.state, event.message) == (
        model_pb.MODEL_STATE_REGISTERED,
        "MODEL_STATE_REGISTERED",
    )
    # Registered again without profiling once more changes nothing (profiling it is
    # test_profile_and_watch_of_models_without_profiles's).
    code, details = _code(lambda: _register(stack, "prof-noroom", path, skip_profiling=True))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "(REGISTERED)" in details
    _delete(stack, "prof-noroom")


def test_a_failing_job_fails_the_model_until_registered_again(stack):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(stack, "prof-broken", **TINY)
    # Registration reads the weights' headers; the worker reads their values, and
    # refuses NaN.
    weights = stack.models_root / path / "model.safetensors"
    sound = weights.read_bytes()
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"][1, 2] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})

    # `iserve register` waits for profiling, drawing its progress on stderr.
    out = _cli(stack, "register", "prof-broken", path)
    assert out.returncode == 1, out
    assert "[" + "." * 30 + "] 0/" in out.stderr and "profiling" in out.stderr
    assert "error: profiling prof-broken failed: base fingerprint(1 layer)" in out.stderr
    assert _watch(stack, "prof-broken")[-1].state == model_pb.MODEL_STATE_FAILED
    model = stack.models.GetModel(model_pb.GetModelRequest(model_id="prof-broken")).model
    assert model.state_reason.startswith("base fingerprint(1 layer) tp=1 pp=1 batch=1: ")
    assert "exited with code 1 before it was ready" in model.state_reason
    assert "'model.embed_tokens.weight'" in model.state_reason
    assert "holds NaN or infinite values" in model.state_reason
    assert _profile_owners(stack) == set() and _profile_workers(stack) == []

    other = make_checkpoint(stack, "prof-other", **TINY)
    code, details = _code(lambda: _register(stack, "prof-broken", other))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "same checkpoint" in details

    weights.write_bytes(sound)  # fixed: new content, new fingerprints
    retried = _register(stack, "prof-broken", path, skip_profiling=True)
    assert retried.state == model_pb.MODEL_STATE_REGISTERED
    _delete(stack, "prof-broken")


def test_a_model_with_a_short_context_is_profiled_on_shorter_lengths(stack):
    """A 32-position context cannot hold the 64-token prompt and 16-token output the
    profiler uses: it profiles with outputs of 8 and 16 after a 16-token prompt (the
    model ended FAILED before, and only explicit deploys were left to it)."""
    path = make_checkpoint(stack, "prof-short", **TINY, max_position_embeddings=32)
    _register(stack, "prof-short", path)
    assert _watch(stack, "prof-short")[-1].state == model_pb.MODEL_STATE_PROFILED
    profile = stack.models.GetProfile(model_pb.GetProfileRequest(model_id="prof-short"))
    assert {(m.input_tokens, m.output_tokens) for m in profile.measurements} == {
        (16, 8),
        (16, 16),
    }
    _delete(stack, "prof-short")


def test_profile_and_watch_of_models_without_profiles(stack):
    code, _ = _code(lambda: stack.models.GetProfile(model_pb.GetProfileRequest(model_id="nope")))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = _code(lambda: _watch(stack, "nope"))
    assert code == grpc.StatusCode.NOT_FOUND

    path = make_checkpoint(stack, "prof-skipped", **TINY)
    _register(stack, "prof-skipped", path, skip_profiling=True)
    [event] = _watch(stack, "prof-skipped")  # nothing will change: one event, then the end
    assert event.state == model_pb.MODEL_STATE_REGISTERED
    code, details = _code(
        lambda: stack.models.GetProfile(model_pb.GetProfileRequest(model_id="prof-skipped"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == "model 'prof-skipped' is not profiled yet (REGISTERED)"
    shown = _cli(stack, "profile", "show", "prof-skipped")
    assert shown.returncode == 1
    assert "FAILED_PRECONDITION: model 'prof-skipped' is not profiled yet" in shown.stderr
    shown = _cli(stack, "profile", "show", "nope")
    assert shown.returncode == 1 and "NOT_FOUND" in shown.stderr
    # Registering it again without --skip-profiling as before changes nothing; with
    # profiling, it profiles the model the skip left unprofiled (the hint says so).
    code, details = _code(lambda: _register(stack, "prof-skipped", path, skip_profiling=True))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "(REGISTERED)" in details, details
    other = make_checkpoint(stack, "prof-skipped-other", **TINY)
    code, details = _code(lambda: _register(stack, "prof-skipped", other))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "only with the same checkpoint" in details
    assert _register(stack, "prof-skipped", path).state == model_pb.MODEL_STATE_PROFILING
    assert _watch(stack, "prof-skipped")[-1].state == model_pb.MODEL_STATE_PROFILED
    _delete(stack, "prof-skipped")


def test_profiling_job_requests_are_checked(stack):
    code, details = _code(
        lambda: stack.agent.RunProfilingJob(agent_pb.RunProfilingJobRequest(request_id=rid()))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "input_tokens must be at least 1"
    request = agent_pb.RunProfilingJobRequest(
        checkpoint_path="../outside",
        workers=[agent_pb.WorkerSpec(rank=0, device_id="cpu0")],
        input_tokens=8,
        output_tokens=[4],
    )
    code, details = _code(lambda: stack.agent.RunProfilingJob(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the models root" in details
    assert _profile_workers(stack) == []


def test_the_cli_registers_compression_variants(stack):
    """`iserve register --variant` (the request's variants were reachable only through
    gRPC, a probe); a variant the service refuses registers nothing."""
    path = make_checkpoint(stack, "prof-variants", **TINY)

    def register(*variants: str):
        flags = [f for v in variants for f in ("--variant", v)]
        return _cli(stack, "register", "prof-variants", path, "--skip-profiling", *flags)

    bad = register("v:pruning=structured,fraction=0.3")
    assert bad.returncode == 1
    assert "INVALID_ARGUMENT" in bad.stderr and "fraction 0.3 cannot be served" in bad.stderr
    listed = _cli(stack, "models", "--json")
    assert "prof-variants" not in listed.stdout
    out = register(
        "int8-kv8:weights=int8,kv=int8,accuracy=41.5", "pruned:pruning=structured,fraction=0.25"
    )
    assert out.returncode == 0, out.stderr
    assert "variants: int8-kv8, pruned" in out.stdout
    model = stack.models.GetModel(model_pb.GetModelRequest(model_id="prof-variants")).model
    by_name = {v.name: v for v in model.variants}
    assert by_name["int8-kv8"].weight_quant == common.WEIGHT_QUANT_INT8
    assert by_name["int8-kv8"].kv_quant == common.KV_QUANT_INT8
    assert by_name["int8-kv8"].accuracy_score == 41.5
    assert by_name["pruned"].pruning == common.PRUNING_STRUCTURED
    assert by_name["pruned"].structured_prune_fraction == 0.25
    _delete(stack, "prof-variants")
