"""StartWorkers validation: what a caller can get wrong, and the error they get."""

from __future__ import annotations

import json
import sys

import pytest

from monitor_agent.devices import virtual_devices
from monitor_agent.launch import build_plan
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.errors import FailedPrecondition, InvalidArgument, Unimplemented

DEVICES = {d.device_id: d for d in virtual_devices(2, 1 << 30, [0, 1], "x86_64")}


@pytest.fixture
def models_root(tmp_path):
    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    (tmp_path / "outside").mkdir()
    return root


def _request(**changes) -> agent_pb.StartWorkersRequest:
    request = agent_pb.StartWorkersRequest(
        request_id="r1",
        deployment_id="dep-1",
        checkpoint_path="tiny",
        config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
        workers=[agent_pb.WorkerSpec(rank=0, device_id="cpu1")],
        engine=agent_pb.ENGINE_KIND_PYTORCH,
    )
    for name, value in changes.items():
        if name == "config":
            request.config.CopyFrom(value)
        elif name == "workers":
            del request.workers[:]
            request.workers.extend(value)
        else:
            setattr(request, name, value)
    return request


def _plan(request, models_root):
    return build_plan(
        request, devices=DEVICES, models_root=models_root, default_ready_timeout_s=42.0
    )


def test_a_valid_request_becomes_a_plan(models_root):
    plan = _plan(_request(), models_root)
    assert plan.deployment_id == "dep-1"
    assert plan.checkpoint_dir == (models_root / "tiny").resolve()
    assert plan.dtype == "float32"
    assert plan.max_seq_len == 512  # capped by the model's max_position_embeddings
    assert plan.max_batch == 1
    assert plan.ready_timeout_s == 42.0
    [worker] = plan.workers
    assert worker.rank == 0 and worker.device.device_id == "cpu1"
    argv = plan.worker_argv(worker, "127.0.0.1", models_root / "ready.json")
    assert argv[:3] == [sys.executable, "-m", "monitor_agent.worker"]
    assert argv[argv.index("--cores") + 1] == "1"
    assert argv[argv.index("--port") + 1] == "0"


def test_request_values_override_the_defaults(models_root):
    config = common.DeploymentConfig(batch_size=3, dtype=common.PRECISION_BFLOAT16)
    plan = _plan(_request(config=config, max_seq_len=256, ready_timeout_ms=1500), models_root)
    assert (plan.dtype, plan.max_batch, plan.max_seq_len) == ("bfloat16", 3, 256)
    assert plan.ready_timeout_s == 1.5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"deployment_id": ""}, "deployment_id is empty"),
        ({"deployment_id": "a:b"}, "must be letters"),
        ({"workers": []}, "workers is empty"),
        ({"workers": [agent_pb.WorkerSpec(rank=0, device_id="cuda9")]}, "not on this node"),
        (
            {
                "workers": [
                    agent_pb.WorkerSpec(rank=0, device_id="cpu0"),
                    agent_pb.WorkerSpec(rank=0, device_id="cpu1"),
                ]
            },
            "repeat a rank",
        ),
        ({"checkpoint_path": ""}, "checkpoint_path is empty"),
        ({"checkpoint_path": "../outside"}, "outside the models root"),
        ({"checkpoint_path": "/etc"}, "outside the models root"),
        ({"checkpoint_path": "missing"}, "not a directory"),
        ({"engine": agent_pb.ENGINE_KIND_UNSPECIFIED}, "engine must be"),
    ],
)
def test_malformed_requests_are_invalid_arguments(models_root, changes, message):
    with pytest.raises(InvalidArgument, match=message):
        _plan(_request(**changes), models_root)


def test_a_symlink_out_of_the_models_root_is_refused(models_root):
    (models_root / "escape").symlink_to(models_root.parent / "outside")
    with pytest.raises(InvalidArgument, match="outside the models root"):
        _plan(_request(checkpoint_path="escape"), models_root)


def test_tensorrt_llm_needs_its_package(models_root):
    request = _request(engine=agent_pb.ENGINE_KIND_TENSORRT_LLM)
    with pytest.raises((FailedPrecondition, Unimplemented), match="TensorRT-LLM|tensorrt_llm"):
        _plan(request, models_root)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (common.DeploymentConfig(tensor_parallel=2), "tp = pp = 1"),
        (common.DeploymentConfig(pipeline_parallel=2), "tp = pp = 1"),
        (common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_INT8), "weight_quant"),
        (common.DeploymentConfig(pruning=common.PRUNING_SEMI_STRUCTURED_2_4), "pruning"),
    ],
)
def test_configurations_the_workers_cannot_run_fail_precondition(models_root, config, message):
    with pytest.raises(FailedPrecondition, match=message):
        _plan(_request(config=config), models_root)
