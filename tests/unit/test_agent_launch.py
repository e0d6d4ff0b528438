"""StartWorkers validation: what a caller can get wrong, and the error they get."""

from __future__ import annotations

import dataclasses
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
    assert not {"--weight-quant", "--kv-quant", "--pruning", "--time-layers"} & set(argv)
    # Profiling jobs ask their workers for a layer clock.
    timed = dataclasses.replace(plan, time_layers=True)
    assert "--time-layers" in timed.worker_argv(worker, "127.0.0.1", models_root / "ready.json")


@pytest.mark.parametrize(
    ("config", "flags"),
    [
        (
            common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_INT8),
            ["--weight-quant", "int8"],
        ),
        (
            common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_INT4),
            ["--weight-quant", "int4"],
        ),
        (common.DeploymentConfig(kv_quant=common.KV_QUANT_INT8), ["--kv-quant", "int8"]),
        (common.DeploymentConfig(pruning=common.PRUNING_SEMI_STRUCTURED_2_4), ["--pruning", "2:4"]),
        (
            common.DeploymentConfig(
                weight_quant=common.WEIGHT_QUANT_INT4, pruning=common.PRUNING_STRUCTURED
            ),
            ["--weight-quant", "int4", "--pruning", "structured", "--prune-fraction", "0.25"],
        ),
    ],
)
def test_compression_becomes_worker_flags(models_root, config, flags):
    plan = _plan(_request(config=config), models_root)
    argv = plan.worker_argv(plan.workers[0], "127.0.0.1", models_root / "ready.json")
    assert argv[-len(flags) :] == flags
    # ... which the worker's own parser accepts.
    from monitor_agent.worker.process import parse_args

    args = parse_args(argv[3:])
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert args.weight_quant == given.get("--weight-quant", "none")
    assert args.kv_quant == given.get("--kv-quant", "none")
    assert args.pruning == given.get("--pruning", "none")
    assert args.prune_fraction == 0.25


def test_unknown_compression_values_are_invalid(models_root):
    with pytest.raises(InvalidArgument, match="config.pruning 7"):
        _plan(_request(config=common.DeploymentConfig(pruning=7)), models_root)


def test_request_values_override_the_defaults(models_root):
    config = common.DeploymentConfig(batch_size=3, dtype=common.PRECISION_BFLOAT16)
    plan = _plan(_request(config=config, max_seq_len=256, ready_timeout_ms=1500), models_root)
    assert (plan.dtype, plan.max_batch, plan.max_seq_len) == ("bfloat16", 3, 256)
    assert plan.ready_timeout_s == 1.5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"deployment_id": ""}, "invalid deployment_id ''"),
        ({"deployment_id": "a:b"}, "invalid deployment_id"),
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
        (common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_GPTQ_INT4), "GPTQ/AWQ"),
        (common.DeploymentConfig(weight_quant=common.WEIGHT_QUANT_AWQ_INT4), "GPTQ/AWQ"),
    ],
)
def test_configurations_the_workers_cannot_run_are_unimplemented(models_root, config, message):
    with pytest.raises(Unimplemented, match=message):
        _plan(_request(config=config), models_root)


def _ranks(tp: int, pp: int, layers: list[tuple[int, int]]) -> list[agent_pb.WorkerSpec]:
    """WorkerSpecs of a tp × pp group, alternating over cpu0 and cpu1."""
    return [
        agent_pb.WorkerSpec(
            rank=stage * tp + t,
            device_id=f"cpu{(stage * tp + t) % 2}",
            stage=stage,
            tensor_rank=t,
            first_layer=layers[stage][0],
            layer_count=layers[stage][1],
        )
        for stage in range(pp)
        for t in range(tp)
    ]


@pytest.fixture
def four_layers(models_root):
    (models_root / "four").mkdir()
    (models_root / "four" / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    return "four"


def test_a_parallel_request_becomes_one_process_per_rank(models_root, four_layers):
    config = common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=2)
    workers = _ranks(2, 2, [(0, 3), (3, 1)])
    plan = _plan(_request(config=config, workers=workers, checkpoint_path=four_layers), models_root)
    assert (plan.tensor_parallel, plan.pipeline_parallel, plan.world_size) == (2, 2, 4)
    assert plan.rendezvous_address == ""  # the supervisor picks one: every rank is here
    last = plan.workers[3]
    assert (last.rank, last.first_layer, last.layer_count) == (3, 3, 1)
    argv = plan.worker_argv(last, "127.0.0.1", models_root / "ready.json")
    flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--rank"] == "3" and flags["--world-size"] == "4"
    assert (flags["--first-layer"], flags["--layer-count"]) == ("3", "1")
    assert flags["--cores"] == "1" and "--rendezvous" not in flags
    tensor_only = _plan(
        _request(
            config=common.DeploymentConfig(tensor_parallel=2),
            workers=_ranks(2, 1, [(0, 4)]),
            rendezvous_address="10.0.0.1:29500",
        ),
        models_root,
    )
    argv = tensor_only.worker_argv(tensor_only.workers[1], "127.0.0.1", models_root / "r.json")
    assert argv[argv.index("--rendezvous") + 1] == "10.0.0.1:29500"
    assert "--first-layer" not in argv  # one stage: the whole model


@pytest.mark.parametrize(
    ("tp", "pp", "workers", "message"),
    [
        (3, 1, _ranks(1, 1, [(0, 4)]), "one of"),
        (2, 1, [agent_pb.WorkerSpec(rank=2, device_id="cpu0")], "outside 0..1"),
        (
            1,
            2,
            [agent_pb.WorkerSpec(rank=1, device_id="cpu0", stage=0, layer_count=2)],
            "must be stage 1 tensor rank 0",
        ),
        (1, 2, _ranks(1, 2, [(0, 2), (2, 0)]), "layer_count is required"),
        (1, 2, _ranks(1, 2, [(0, 2), (2, 3)]), "outside the model's 4 layers"),
        (2, 1, _ranks(2, 1, [(0, 4)])[:1], "rendezvous_address is required"),
    ],
)
def test_malformed_parallel_requests_are_invalid(
    models_root, four_layers, tp, pp, workers, message
):
    config = common.DeploymentConfig(tensor_parallel=tp, pipeline_parallel=pp)
    request = _request(config=config, workers=workers, checkpoint_path=four_layers)
    with pytest.raises(InvalidArgument, match=message):
        _plan(request, models_root)
