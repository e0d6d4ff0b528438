"""Hostile input through real gRPC: lying checkpoints, ids with separators, unknown enum
values, absurd sampling and sizes. Each gets INVALID_ARGUMENT naming the problem; no
model, deployment, reservation, Redis key or worker is left behind; every service and
the served worker still answer. (test_bad_inputs covers the plainer cases: a path
outside the root, malformed config.json, an unsupported family, a truncated file.)"""

from __future__ import annotations

import asyncio
import json
import math
import struct

import grpc
import psutil
import pytest

from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.models.checkpoint import create_checkpoint
from services.models.tokenizer import build_tokenizer
from tests.integration.helpers import (
    TINY,
    deploy,
    generate,
    make_checkpoint,
    reserved_by_device,
    rid,
    wait_for,
)
from tests.integration.test_bad_inputs import _deployment_ids, _model_ids, _worker_stats

pytestmark = pytest.mark.integration

# Every model, request and deployment id these tests try contains this, so a SCAN finds
# whatever they might have left in Redis.
MARK = "hostile"


def _refused(call) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def _redis_keys(stack, pattern: str) -> set[str]:
    async def scan() -> set[str]:
        store = stack.store()
        try:
            return {
                k if isinstance(k, str) else k.decode()
                async for k in store.redis.scan_iter(match=pattern)
            }
        finally:
            await store.close()

    return asyncio.run(scan())


def _live_workers(stack) -> list[tuple[str, int, int]]:
    workers = stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    return sorted(
        (w.deployment_id, w.rank, w.pid)
        for w in workers
        if w.state in (agent_pb.WORKER_STATE_STARTING, agent_pb.WORKER_STATE_READY)
    )


def _state(stack) -> tuple:
    """Everything a refused request must leave as it was."""
    return (
        _model_ids(stack),
        _deployment_ids(stack),
        reserved_by_device(stack),
        _live_workers(stack),
        _redis_keys(stack, f"*{MARK}*"),
    )


def _rewrite_header(path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _lying_checkpoints(stack, tmp_path) -> dict[str, str]:
    """checkpoint path -> a phrase its refusal must contain."""
    root = stack.models_root
    cases: dict[str, str] = {}

    def checkpoint(name: str, **config_changes):
        directory = create_checkpoint(root / name, **TINY, overwrite=True)
        if config_changes:
            config = json.loads((directory / "config.json").read_text())
            config.update(config_changes)
            (directory / "config.json").write_text(json.dumps(config))
        return directory

    weights = checkpoint(f"{MARK}-overlap") / "model.safetensors"
    header_len = struct.unpack("<Q", weights.read_bytes()[:8])[0]
    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    data = weights.read_bytes()[8 + header_len :]
    names = [n for n in header if n != "__metadata__"]
    first, second = header[names[0]], header[names[1]]
    second["data_offsets"] = [
        first["data_offsets"][0],
        first["data_offsets"][0] + second["data_offsets"][1] - second["data_offsets"][0],
    ]
    _rewrite_header(weights, json.dumps(header).encode(), data)
    cases[f"{MARK}-overlap"] = "overlaps"

    weights = checkpoint(f"{MARK}-trailing") / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + bytes(64))
    cases[f"{MARK}-trailing"] = "trailing bytes"

    weights = checkpoint(f"{MARK}-huge-header") / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 10**12) + weights.read_bytes()[8:])
    cases[f"{MARK}-huge-header"] = "more than the 100000000"

    weights = checkpoint(f"{MARK}-deep-json") / "model.safetensors"
    _rewrite_header(weights, b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}", b"")
    cases[f"{MARK}-deep-json"] = "nested too deeply"

    weights = checkpoint(f"{MARK}-dtype") / "model.safetensors"
    header_len = struct.unpack("<Q", weights.read_bytes()[:8])[0]
    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    header[names[0]]["dtype"] = "F128"
    _rewrite_header(weights, json.dumps(header).encode(), weights.read_bytes()[8 + header_len :])
    cases[f"{MARK}-dtype"] = "unknown dtype 'F128'"

    checkpoint(f"{MARK}-layers-str", num_hidden_layers="2")
    cases[f"{MARK}-layers-str"] = "'num_hidden_layers' must be a positive integer"
    checkpoint(f"{MARK}-layers-huge", num_hidden_layers=10**12)
    cases[f"{MARK}-layers-huge"] = "more than the 1024"
    checkpoint(f"{MARK}-eps-nan", rms_norm_eps=math.nan)
    cases[f"{MARK}-eps-nan"] = "'rms_norm_eps'"
    checkpoint(f"{MARK}-heads-zero", num_attention_heads=0)
    cases[f"{MARK}-heads-zero"] = "'num_attention_heads'"

    outside = create_checkpoint(tmp_path / "outside", **TINY)
    linked = checkpoint(f"{MARK}-linked")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")
    cases[f"{MARK}-linked"] = "links outside the models root"
    (root / f"{MARK}-dir-link").unlink(missing_ok=True)
    (root / f"{MARK}-dir-link").symlink_to(outside)
    cases[f"{MARK}-dir-link"] = "outside the models root"
    cases[f"{MARK}-overlap/../../etc"] = "outside the models root"
    cases[f"{MARK}-overlap\x00"] = "NUL byte"
    cases["x" * 5000] = "cannot be read"
    return cases


def test_register_refuses_lying_checkpoints_and_records_nothing(stack, tmp_path):
    cases = _lying_checkpoints(stack, tmp_path)
    before = _state(stack)
    for path, phrase in cases.items():
        details = _refused(
            lambda path=path: stack.models.RegisterModel(
                model_pb.RegisterModelRequest(
                    request_id=rid(), model_id=f"{MARK}-model", checkpoint_path=path
                )
            )
        )
        assert phrase in details, (path[:40], details)
        assert len(details) < 1000
    good = make_checkpoint(stack, f"{MARK}-good")
    hostile_fields = [
        (dict(model_id=f"{MARK}:a"), "model_id"),
        (dict(model_id=f"{MARK}/../a"), "model_id"),
        (dict(model_id=f"{MARK}\n"), "model_id"),
        (dict(model_id=f"{MARK}\x00"), "model_id"),
        (dict(model_id=MARK + "x" * 100_000), "100007 characters"),
        (dict(request_id=f"{MARK} a"), "request_id"),
        (dict(accuracy_score=math.nan), "accuracy_score"),
    ]
    variant = dict(
        name=f"{MARK}-v",
        weight_quant=common.WEIGHT_QUANT_INT8,
        kv_quant=common.KV_QUANT_NONE,
        pruning=common.PRUNING_NONE,
    )
    for changes, phrase in [
        (dict(weight_quant=42), "weight_quant 42"),
        (dict(kv_quant=0), "kv_quant must be set"),
        (dict(name=f"{MARK}:v"), "variant name"),
        (dict(accuracy_score=math.inf), "accuracy_score"),
    ]:
        hostile_fields.append(
            (dict(variants=[common.CompressionVariant(**{**variant, **changes})]), phrase)
        )
    for fields, phrase in hostile_fields:
        request = model_pb.RegisterModelRequest(
            **{
                "request_id": rid(),
                "model_id": f"{MARK}-model",
                "checkpoint_path": good,
                "skip_profiling": True,
                **fields,
            }
        )
        details = _refused(lambda request=request: stack.models.RegisterModel(request))
        assert phrase in details, details
    assert _state(stack) == before
    # Still serving.
    stack.models.ListModels(model_pb.ListModelsRequest(), timeout=10)


def _text_of_tokens(count: int) -> str:
    """Text that create_checkpoint's tokenizer encodes to at least ``count`` tokens and
    not many more."""
    tokenizer = build_tokenizer()
    words = ["river"]
    while len(tokenizer.encode(" ".join(words)).ids) < count:
        words.append("river")
    return " ".join(words)


def test_hostile_generate_requests_are_refused_and_the_worker_lives_on(stack, served):
    [worker] = stack.agent.ListWorkers(
        agent_pb.ListWorkersRequest(deployment_id=served.deployment_id)
    ).workers
    before = _state(stack)
    deployment = stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id=served.deployment_id)
    ).deployment
    room = deployment.max_input_tokens + deployment.max_output_tokens - 4
    vocab = build_tokenizer().get_vocab_size()  # create_checkpoint's default vocabulary
    cases = [
        (dict(prompt_token_ids=[1, vocab]), f"outside [0, {vocab})"),
        (dict(prompt_token_ids=[1, vocab + 10, 2]), f"outside [0, {vocab})"),
        (dict(prompt_token_ids=[2**32 - 1]), f"outside [0, {vocab})"),
        # max_tokens 4 (below) leaves a prompt the rest of the sequence (OpenAI's rule).
        (dict(prompt_token_ids=[1] * (room + 1)), f"accepts at most {room}"),
        # The same bound on a text prompt, which only the worker encodes.
        # ... saying what the limit is made of, as for token ids (a probe: a chat user
        # read "at most 752" of a deployment whose max_input_tokens is 512).
        (
            dict(prompt=_text_of_tokens(room + 2)),
            f"accepts at most {room} (max_input_tokens + max_output_tokens - max_tokens)",
        ),
        (dict(prompt="word " * 4000), f"accepts at most {room}"),
        (dict(prompt="hi", max_tokens=2**32 - 1), "max_output_tokens"),
        (dict(prompt="hi", sampling=common.SamplingParams(temperature=math.nan)), "temperature"),
        (dict(prompt="hi", sampling=common.SamplingParams(temperature=math.inf)), "temperature"),
        (dict(prompt="hi", sampling=common.SamplingParams(top_p=math.nan)), "top_p"),
        (dict(prompt="hi", sampling=common.SamplingParams(top_p=-0.5)), "top_p"),
        (dict(prompt="hi", request_id=f"{MARK}/x"), "request_id"),
        (dict(prompt="hi", request_id=".."), "request_id"),
    ]
    for fields, phrase in cases:
        fields = {"deployment_id": served.deployment_id, "max_tokens": 4, **fields}
        details = _refused(lambda fields=fields: generate(stack, **fields))
        assert phrase in details, (fields.get("prompt", "")[:20], details)
    for target in [
        dict(deployment_id=f"{MARK}:x"),
        dict(deployment_id="../" + served.deployment_id),
        dict(deployment_id=".."),
        dict(deployment_id=f"{MARK}\x00"),
        dict(deployment_id="x" * 100_000),
        dict(model_id=f"{MARK}\n"),
        dict(model_id=f"{MARK}/a"),
    ]:
        details = _refused(
            lambda target=target: generate(stack, prompt="hi", max_tokens=2, **target)
        )
        assert "_id" in details and len(details) < 1000, details
    # Meaningful extremes are served: a near-zero temperature is greedy (it used to turn
    # the logits into NaN and fail the whole batch), a huge one and top_k are uniform.
    for sampling in [
        common.SamplingParams(temperature=1e-38, top_p=0.5),
        common.SamplingParams(temperature=1e9, top_k=2**32 - 1, seed=2**64 - 1),
    ]:
        _, final = generate(
            stack, deployment_id=served.deployment_id, prompt="hi", max_tokens=3, sampling=sampling
        )
        assert final.usage.completion_tokens >= 1
    # The worker was never replaced, holds no request, and still serves.
    assert psutil.pid_exists(worker.pid)
    assert wait_for(lambda: _worker_stats(served.worker_address).active_requests == 0, 10)
    _, final = generate(stack, deployment_id=served.deployment_id, prompt="hi", max_tokens=2)
    assert final.usage.completion_tokens == 2
    assert _state(stack) == before
    stats = stack.inference.GetServingStats(infer_pb.GetServingStatsRequest(), timeout=10)
    assert not [s for s in stats.deployments if MARK in s.deployment_id]


def test_hostile_deploy_requests_are_refused_leaving_nothing(stack, served):
    before = _state(stack)
    tp1 = dict(tensor_parallel=1, pipeline_parallel=1)
    cases = [
        (dict(config=common.DeploymentConfig(**tp1, dtype=42)), "dtype 42"),
        (dict(config=common.DeploymentConfig(**tp1, kv_quant=42)), "kv_quant 42"),
        (dict(config=common.DeploymentConfig(tensor_parallel=2**32 - 1)), "tensor_parallel"),
        (dict(placement_policy=42), "placement policy 42"),
        (dict(objectives=common.ServiceObjectives(scheduling=42)), "scheduling policy 42"),
        (dict(batch_size=2**32 - 1), "batch_size"),
        (dict(max_output_tokens=2**32 - 1), "max_output_tokens"),
        (dict(max_input_tokens=2**32 - 1), "max_input_tokens"),
        (dict(replicas=2**32 - 1), "replicas must be at most"),
        (dict(request_id=f"{MARK}:1"), "request_id"),
        (dict(request_id=".."), "request_id"),
    ]
    intents = [
        (dict(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=math.inf), "latency_slo_ms"),
        (dict(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=1e300), "latency_slo_ms"),
        (dict(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=math.nan), "latency_slo_ms"),
        (dict(kind=common.INTENT_KIND_MIN_COST, cost_formula=42), "cost formula"),
        (dict(kind=common.INTENT_KIND_MIN_COST, min_accuracy=math.nan), "min_accuracy"),
        (dict(kind=42), "intent kind"),
    ]
    for fields, phrase in cases:
        fields = {"request_id": f"{MARK}-{rid()}", **fields}
        details = _refused(lambda fields=fields: deploy(stack, served.model_id, **fields))
        assert phrase in details, details
    for intent, phrase in intents:
        request = deploy_pb.DeployRequest(
            request_id=f"{MARK}-{rid()}", model_id=served.model_id, intent=common.Intent(**intent)
        )
        details = _refused(lambda request=request: stack.deployments.Deploy(request, timeout=60))
        assert phrase in details, details
    for model_id in [f"{MARK}:a", f"../{MARK}", f"{MARK}\n", f"{MARK}\x00", "x" * 100_000]:
        details = _refused(lambda model_id=model_id: deploy(stack, model_id))
        assert "model_id" in details and len(details) < 1000, details
    for deployment_id in [f"{MARK}:a", "..", f"{MARK}/../x", "x" * 100_000]:
        for call in (
            lambda d=deployment_id: stack.deployments.GetDeployment(
                deploy_pb.GetDeploymentRequest(deployment_id=d)
            ),
            lambda d=deployment_id: stack.deployments.RemoveDeployment(
                deploy_pb.RemoveDeploymentRequest(deployment_id=d)
            ),
        ):
            assert "deployment_id" in _refused(call)
    assert _state(stack) == before
    stack.deployments.GetClusterState(deploy_pb.GetClusterStateRequest(), timeout=10)
