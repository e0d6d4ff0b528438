"""Every bad input gets a clear status and leaves nothing behind."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.models.checkpoint import create_checkpoint
from tests.conftest import QUEUE_CAPACITY
from tests.integration.helpers import (
    TINY,
    cli,
    deploy,
    generate,
    make_checkpoint,
    register,
    reserved_by_device,
    rid,
    wait_for,
)

pytestmark = pytest.mark.integration


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _model_ids(stack) -> set[str]:
    return {m.model_id for m in stack.models.ListModels(model_pb.ListModelsRequest()).models}


def _deployment_ids(stack) -> set[str]:
    return {
        d.deployment_id
        for d in stack.deployments.ListDeployments(deploy_pb.ListDeploymentsRequest()).deployments
    }


def test_register_rejects_bad_checkpoints_and_records_nothing(stack, tmp_path):
    outside = tmp_path / "outside"
    create_checkpoint(outside, **TINY)
    malformed = stack.models_root / "malformed"
    create_checkpoint(malformed, **TINY, overwrite=True)
    (malformed / "config.json").write_text("{ not json")
    unsupported = stack.models_root / "unsupported"
    create_checkpoint(unsupported, **TINY, overwrite=True)
    config = json.loads((unsupported / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertModel"])
    (unsupported / "config.json").write_text(json.dumps(config))
    truncated = stack.models_root / "truncated"
    create_checkpoint(truncated, **TINY, overwrite=True)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])

    before = _model_ids(stack)
    cases = {
        str(outside): "outside the models root",
        "../outside": "outside the models root",
        "missing-dir": "does not exist",
        "malformed": "config.json",
        "unsupported": "bert",
        "truncated": "model.safetensors",
    }
    for path, phrase in cases.items():
        code, details = _code(
            lambda path=path: stack.models.RegisterModel(
                model_pb.RegisterModelRequest(
                    request_id=rid(), model_id="bad-model", checkpoint_path=path
                )
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, details)
        assert phrase in details, (path, details)
    code, details = _code(
        lambda: stack.models.RegisterModel(
            model_pb.RegisterModelRequest(model_id="Bad Id!", checkpoint_path="malformed")
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model_id" in details
    assert _model_ids(stack) == before


def test_register_twice_is_already_exists(stack):
    path = make_checkpoint(stack, "twice")
    register(stack, "twice", path)
    code, details = _code(lambda: register(stack, "twice", path))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "twice" in details
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="twice"))


def test_a_model_may_not_take_a_deployments_id(stack, served):
    """A deployment's id names that deployment where a model's id goes, and a model of
    the same id came first: another tenant who registered one took the deployment's
    requests and refused its owner (a probe). Refused, nothing registered."""
    before = _model_ids(stack)
    path = make_checkpoint(stack, "id-thief")
    code, details = _code(lambda: register(stack, served.deployment_id, path))
    assert code == grpc.StatusCode.ALREADY_EXISTS, details
    assert f"model id {served.deployment_id!r} is a deployment's id" in details
    assert _model_ids(stack) == before
    # The deployment still serves its id.
    deltas, _ = generate(stack, model_id=served.deployment_id, prompt="hi", max_tokens=2)
    assert sum(len(d.token_ids) for d in deltas) == 2


def test_deploy_needing_more_memory_than_free_is_resource_exhausted(stack):
    path = make_checkpoint(
        stack, "kv-hungry", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8
    )
    register(stack, "kv-hungry", path)
    reserved, deployments = reserved_by_device(stack), _deployment_ids(stack)
    # 256 slots x 2048 positions of KV cache is 4 GiB; the devices have 2 GiB each.
    code, details = _code(
        lambda: deploy(
            stack, "kv-hungry", batch_size=256, max_input_tokens=1792, max_output_tokens=256
        )
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "largest free: 2048 MiB" in details
    assert reserved_by_device(stack) == reserved
    assert _deployment_ids(stack) == deployments
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="kv-hungry"))


def test_deploy_rejects_bad_configurations(stack, served):
    reserved, deployments = reserved_by_device(stack), _deployment_ids(stack)
    cases = [
        (
            dict(config=common.DeploymentConfig(tensor_parallel=3)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tensor_parallel",
        ),
        (
            dict(config=common.DeploymentConfig(pipeline_parallel=9)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "pipeline_parallel",
        ),
        (
            dict(config=common.DeploymentConfig(variant_name="int3")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "variant",
        ),
        (dict(max_input_tokens=4000), grpc.StatusCode.INVALID_ARGUMENT, "positions"),
        (
            dict(config=common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_GPTQ_INT4)),
            grpc.StatusCode.UNIMPLEMENTED,
            "GPTQ/AWQ",
        ),
        (
            dict(config=common.DeploymentConfig(pruning=99)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "pruning 99",
        ),
        # tp·pp ranks need as many devices; the stack has two.
        (
            dict(config=common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=2)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "needs 4 devices, the cluster has 2",
        ),
    ]
    for fields, status, phrase in cases:
        code, details = _code(lambda fields=fields: deploy(stack, served.model_id, **fields))
        assert (code, phrase in details) == (status, True), details
    code, details = _code(
        lambda: stack.deployments.Deploy(
            deploy_pb.DeployRequest(request_id=rid(), model_id=served.model_id)
        )
    )
    # No configuration: the default intent (min-cost) needs a profile this model lacks.
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "is not profiled yet (REGISTERED)" in details
    code, details = _code(
        lambda: stack.deployments.Deploy(
            deploy_pb.DeployRequest(
                request_id=rid(), model_id=served.model_id, intent=common.Intent(kind=42)
            )
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "intent kind" in details
    assert reserved_by_device(stack) == reserved
    assert _deployment_ids(stack) == deployments


def test_generate_rejects_bad_requests(stack, served):
    cases = [
        (dict(prompt=""), "empty"),
        (dict(prompt="hi", max_tokens=served.max_output_tokens + 1), str(served.max_output_tokens)),
        (dict(prompt="hi", sampling=common.SamplingParams(temperature=-1)), "temperature"),
        (dict(prompt="hi", sampling=common.SamplingParams(top_p=1.5)), "top_p"),
    ]
    for fields, phrase in cases:
        fields.setdefault("max_tokens", 4)
        code, details = _code(
            lambda fields=fields: generate(stack, deployment_id=served.deployment_id, **fields)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (fields, details)
        assert phrase in details, (fields, details)
    code, _ = _code(lambda: generate(stack, prompt="hi", max_tokens=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


class _Stream:
    """A generation consumed on a thread; ``first`` is set at the first delta."""

    def __init__(self, stack, **fields):
        from services.api import inference_service_pb2 as infer_pb

        self.request_id = rid()
        self.call = stack.inference.Generate(
            infer_pb.GenerateRequest(request_id=self.request_id, **fields), timeout=120
        )
        self.first = threading.Event()
        self.error: grpc.RpcError | None = None
        self.tokens = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for message in self.call:
                if message.HasField("delta"):
                    self.tokens += len(message.delta.token_ids)
                    self.first.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first.set()


def _long(served) -> dict:
    return dict(
        deployment_id=served.deployment_id,
        prompt="Once upon a time",
        max_tokens=served.max_output_tokens,
        sampling=common.SamplingParams(ignore_eos=True),
    )


def _worker_stats(address: str) -> worker_pb.GetWorkerStatsResponse:
    with grpc.insecure_channel(address) as ch:
        return worker_service_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(
            worker_pb.GetWorkerStatsRequest()
        )


def _waiting(stack, deployment_id: str) -> int:
    """Requests of the deployment waiting for a slot, as the scheduler counts them."""
    stats = stack.inference.GetServingStats(infer_pb.GetServingStatsRequest(), timeout=10)
    return sum(d.requests_waiting for d in stats.deployments if d.deployment_id == deployment_id)


def test_queue_full_is_resource_exhausted(stack, served):
    running = _Stream(stack, **_long(served))
    assert running.first.wait(60) and running.error is None
    waiting = [_Stream(stack, **_long(served)) for _ in range(QUEUE_CAPACITY)]
    try:
        # The scheduler says its queue is full (QUEUE_CAPACITY waiting behind the running
        # one) before the probe: one sent earlier would be queued, not refused.
        assert wait_for(
            lambda: _waiting(stack, served.deployment_id) >= QUEUE_CAPACITY, timeout=60
        ), (_waiting(stack, served.deployment_id), running.error, [w.error for w in waiting])
        with pytest.raises(grpc.RpcError) as rejected:
            generate(
                stack, timeout=30, deployment_id=served.deployment_id, prompt="hi", max_tokens=2
            )
        assert rejected.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, rejected.value
        assert "full" in rejected.value.details()
    finally:
        for stream in [running, *waiting]:
            stream.call.cancel()
        for stream in [running, *waiting]:
            stream.thread.join(30)
    # Cancelled calls stop on the worker and free the queue.
    assert wait_for(lambda: _worker_stats(served.worker_address).active_requests == 0, timeout=15)
    _, final = generate(stack, deployment_id=served.deployment_id, prompt="hi", max_tokens=2)
    assert final.usage.completion_tokens == 2


def test_cancel_stops_generation_on_the_worker(stack, served):
    stream = _Stream(stack, **_long(served))
    assert stream.first.wait(60)
    before = _worker_stats(served.worker_address).tokens_generated
    stream.call.cancel()
    stream.thread.join(30)
    assert wait_for(lambda: _worker_stats(served.worker_address).active_requests == 0, timeout=10)
    after = _worker_stats(served.worker_address).tokens_generated
    assert after - before < served.max_output_tokens // 2
    # The scheduler's log has a line for it, as for a served request (it had none).
    log = stack.settings.state_dir / "logs" / "scheduler.log"
    ended = f"request {stream.request_id} ended by the client (CANCELLED) after"
    assert wait_for(lambda: ended in log.read_text(errors="replace"), timeout=10)


def test_deploying_a_model_without_a_checkpoint_is_failed_precondition(stack):
    import asyncio

    async def record():
        store = stack.store()
        try:
            await store.create_model(
                model_pb.Model(model_id="shape-only", state=model_pb.MODEL_STATE_PROFILED)
            )
        finally:
            await store.close()

    asyncio.run(record())
    reserved = reserved_by_device(stack)
    code, details = _code(lambda: deploy(stack, "shape-only"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no checkpoint" in details
    assert reserved_by_device(stack) == reserved
    stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="shape-only"))


def test_a_short_context_model_deploys_with_limits_that_fit_it(stack):
    """Plain `iserve deploy MODEL --tp 1 --pp 1` on a 256-position model: the default
    limits are split from its context; an explicit limit beyond it is refused, leaving
    nothing behind."""
    register(stack, "short-ctx", make_checkpoint(stack, "short-ctx", max_position_embeddings=256))
    before = (_deployment_ids(stack), reserved_by_device(stack))
    refused = cli(stack, "deploy", "short-ctx", "--tp", "1", "--pp", "1", "--max-input", "300")
    assert refused.returncode != 0
    assert "INVALID_ARGUMENT" in refused.stderr
    assert "max_input_tokens 300 leaves no room for output" in refused.stderr
    assert (_deployment_ids(stack), reserved_by_device(stack)) == before
    out = cli(stack, "deploy", "short-ctx", "--tp", "1", "--pp", "1")
    assert out.returncode == 0, out.stderr
    deployment_id = out.stdout.strip().splitlines()[-1]
    deployment = stack.deployments.GetDeployment(
        deploy_pb.GetDeploymentRequest(deployment_id=deployment_id)
    ).deployment
    assert (deployment.max_input_tokens, deployment.max_output_tokens) == (171, 85)
    deltas, final = generate(
        stack, deployment_id=deployment_id, prompt_token_ids=[1, 5, 9], max_tokens=8
    )
    assert deltas and final.finish_reason
    # The model's id where the deployment's goes: said, with the ids to remove.
    by_model = cli(stack, "remove", "short-ctx")
    assert by_model.returncode == 1
    assert (
        f"short-ctx is a model; remove one of its deployments: {deployment_id}" in by_model.stderr
    )
    assert cli(stack, "remove", deployment_id).returncode == 0


def test_every_rpc_refuses_a_bad_request_id_before_anything_else(stack):
    """A 1 MB request_id was refused by some RPCs and echoed back whole by others
    (ListDeployments, GetModel, ListWorkers, StopWorkers...): every RPC of every service
    that has a request_id now refuses a bad one with INVALID_ARGUMENT, first, whatever
    else the request holds (an empty one here)."""
    from google.protobuf import symbol_database

    from services.api import (
        agent_service_pb2,
        deployment_service_pb2,
        estimator_service_pb2,
        inference_service_pb2,
        model_service_pb2,
        token_service_pb2,
    )

    modules = {
        "model": [model_service_pb2],
        "estimator": [estimator_service_pb2],
        "deploy": [deployment_service_pb2, token_service_pb2],
        "scheduler": [inference_service_pb2],
        "agent": [agent_service_pb2],
    }
    database = symbol_database.Default()
    checked = []
    for name, pb_modules in modules.items():
        chan = grpc.insecure_channel(stack.settings.address(name))
        try:
            for module in pb_modules:
                for service in module.DESCRIPTOR.services_by_name.values():
                    for method in service.methods:
                        request_class = database.GetSymbol(method.input_type.full_name)
                        if "request_id" not in request_class.DESCRIPTOR.fields_by_name:
                            continue
                        path = f"/{service.full_name}/{method.name}"
                        request = request_class(request_id="x" * (1 << 20))
                        kind = chan.unary_stream if method.server_streaming else chan.unary_unary
                        call = kind(
                            path,
                            request_serializer=request_class.SerializeToString,
                            response_deserializer=lambda data: data,
                        )
                        with pytest.raises(grpc.RpcError) as refused:
                            reply = call(request, timeout=30)
                            if method.server_streaming:
                                next(iter(reply))
                        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
                        assert "invalid request_id 'xxx" in refused.value.details(), path
                        assert len(refused.value.details()) < 300, path
                        checked.append(method.name)
        finally:
            chan.close()
    assert {"ListDeployments", "GetModel", "ListWorkers", "StopWorkers", "Generate"} <= set(
        checked
    ), checked
