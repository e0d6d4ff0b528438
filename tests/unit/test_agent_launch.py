"""StartWorkers validation: what a caller can get wrong, and the error they get."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import logging
import sys
import types

import pytest

from monitor_agent.devices import DeviceSpec, virtual_devices
from monitor_agent.launch import build_plan
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.errors import FailedPrecondition, InvalidArgument, Unimplemented
from services.models.checkpoint import create_checkpoint

DEVICES = {d.device_id: d for d in virtual_devices(2, 1 << 30, [0, 1], "x86_64")}
GPUS = [
    DeviceSpec(f"cuda{i}", common.DEVICE_KIND_CUDA, "H100", "h100", 80 << 30, (i,), cuda_index=i)
    for i in range(4)
]
DEVICES |= {d.device_id: d for d in GPUS}


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
        if name in ("config", "expected_shape"):
            getattr(request, name).CopyFrom(value)
        elif name == "workers":
            del request.workers[:]
            request.workers.extend(value)
        else:
            setattr(request, name, value)
    return request


def test_the_default_sequence_length_reads_positions_as_the_family_does(models_root):
    """GPT-J names its positions n_positions: a default of 2048 would start a worker that
    refuses it; a max_seq_len beyond them is refused before a worker starts."""
    create_checkpoint(
        models_root / "gptj",
        arch="gptj",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        max_position_embeddings=512,
    )
    gptj = json.loads((models_root / "gptj" / "config.json").read_text())
    assert gptj["n_positions"] == 512 and "max_position_embeddings" not in gptj
    assert _plan(_request(checkpoint_path="gptj"), models_root).max_seq_len == 512
    with pytest.raises(
        InvalidArgument, match=r"max_seq_len 513 \(.*\) exceeds the model's 512 positions"
    ):
        _plan(_request(checkpoint_path="gptj", max_seq_len=513), models_root)


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
                ],
                "config": common.DeploymentConfig(tensor_parallel=2),
            },
            "repeat a rank",
        ),
        # A fuzzing tester: 100k WorkerSpecs, and a batch no deployer would ask for (a
        # failed 70 TB allocation later, FAILED_PRECONDITION).
        (
            {"workers": [agent_pb.WorkerSpec(rank=0, device_id="cpu0")] * 100_000},
            "100000 workers for a group of tp 1 x pp 1",
        ),
        ({"config": common.DeploymentConfig(batch_size=1 << 30)}, "batch_size must be at most 256"),
        # A checkpoint whose config names no layer count: a bound of its own.
        (
            {"config": common.DeploymentConfig(pipeline_parallel=1000)},
            "config.pipeline_parallel must be 1..8, got 1000",
        ),
        # The worker refused it at start-up and exited: FAILED_PRECONDITION (a tester).
        (
            {"max_seq_len": 2**32 - 1},
            r"max_seq_len 4294967295 \(.*\) exceeds the model's \d+ positions",
        ),
        ({"checkpoint_path": ""}, "checkpoint_path is empty"),
        ({"checkpoint_path": "../outside"}, "outside the models root"),
        ({"checkpoint_path": "/etc"}, "outside the models root"),
        ({"checkpoint_path": "missing"}, "not a directory"),
        ({"engine": 7}, "engine 7 is not an EngineKind"),
    ],
)
def test_malformed_requests_are_invalid_arguments(models_root, changes, message):
    with pytest.raises(InvalidArgument, match=message):
        _plan(_request(**changes), models_root)


def test_a_symlink_out_of_the_models_root_is_refused(models_root):
    (models_root / "escape").symlink_to(models_root.parent / "outside")
    with pytest.raises(InvalidArgument, match="outside the models root"):
        _plan(_request(checkpoint_path="escape"), models_root)


def test_tensorrt_llm_needs_its_package(models_root, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # find_spec: not installed
    request = _request(engine=agent_pb.ENGINE_KIND_TENSORRT_LLM)
    with pytest.raises(FailedPrecondition, match="tensorrt_llm is not installed"):
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
        # More stages than layers: a worker waited for peers that cannot exist, or the
        # group failed in torch's own words (a fuzzing tester).
        (1, 5, _ranks(1, 1, [(0, 1)]), "pipeline_parallel must be 1..4 for 4 layers, got 5"),
        (1, 2**32 - 1, _ranks(1, 1, [(0, 1)]), "must be 1..4 for 4 layers, got 4294967295"),
    ],
)
def test_malformed_parallel_requests_are_invalid(
    models_root, four_layers, tp, pp, workers, message
):
    config = common.DeploymentConfig(tensor_parallel=tp, pipeline_parallel=pp)
    request = _request(config=config, workers=workers, checkpoint_path=four_layers)
    with pytest.raises(InvalidArgument, match=message):
        _plan(request, models_root)


# --- the engine: ENGINE_KIND x ISERVE_ENGINE x the node --------------------------------


def _installed(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    """Make ``tensorrt_llm`` findable (a stand-in module with a spec) or not (None in
    sys.modules, which find_spec reads as absent)."""
    if installed:
        stand_in = types.ModuleType("tensorrt_llm")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("tensorrt_llm", None)
        monkeypatch.setitem(sys.modules, "tensorrt_llm", stand_in)
    else:
        monkeypatch.setitem(sys.modules, "tensorrt_llm", None)


# Rank r's device for each kind of node: four GPUs, two CPU devices, or GPUs and a CPU.
_GROUP_DEVICES = {
    "cuda": ["cuda0", "cuda1", "cuda2", "cuda3"],
    "cpu": ["cpu0", "cpu1", "cpu0", "cpu1"],
    "mixed": ["cuda0", "cuda1", "cuda2", "cpu1"],
}


def _group_request(
    engine: int, devices: str = "cuda", whole: bool = True, **config
) -> agent_pb.StartWorkersRequest:
    """A tp=2 × pp=2 group of the 4-layer model (stages of 3 and 1 layers); ``whole``:
    this node runs every rank, else ranks 0 and 1 with a rendezvous."""
    workers = _ranks(2, 2, [(0, 3), (3, 1)])
    for spec, device_id in zip(workers, _GROUP_DEVICES[devices], strict=True):
        spec.device_id = device_id
    return _request(
        config=common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=2, **config),
        workers=workers if whole else workers[:2],
        checkpoint_path="four",
        engine=engine,
        rendezvous_address="" if whole else "10.0.0.1:29500",
    )


UNSPECIFIED = agent_pb.ENGINE_KIND_UNSPECIFIED
PYTORCH = agent_pb.ENGINE_KIND_PYTORCH
TRTLLM = agent_pb.ENGINE_KIND_TENSORRT_LLM
PRUNED = {"pruning": common.PRUNING_SEMI_STRUCTURED_2_4}


@pytest.mark.parametrize(
    ("engine", "env", "installed", "devices", "whole", "config", "expected"),
    [
        # PYTORCH is the PyTorch engine whatever the node offers or prefers.
        (PYTORCH, "auto", True, "cuda", True, {}, "pytorch"),
        (PYTORCH, "tensorrt_llm", True, "cuda", True, {}, "pytorch"),
        (PYTORCH, "tensorrt_llm", False, "cpu", False, {}, "pytorch"),
        # TENSORRT_LLM: TensorRT-LLM, or the error saying why not.
        (TRTLLM, "pytorch", True, "cuda", True, {}, "tensorrt_llm"),
        (TRTLLM, "auto", True, "cuda", True, {}, "tensorrt_llm"),
        (
            TRTLLM,
            "auto",
            False,
            "cuda",
            True,
            {},
            "FailedPrecondition:tensorrt_llm is not installed",
        ),
        (
            TRTLLM,
            "auto",
            True,
            "cpu",
            True,
            {},
            "FailedPrecondition:NVIDIA GPUs only, not on 'cpu'",
        ),
        (TRTLLM, "auto", True, "mixed", True, {}, "FailedPrecondition:NVIDIA GPUs only"),
        (
            TRTLLM,
            "auto",
            True,
            "cuda",
            False,
            {},
            "FailedPrecondition:runs 2 of the group's 4 ranks",
        ),
        (TRTLLM, "auto", True, "cuda", True, PRUNED, "InvalidArgument:pruning '2:4' does not map"),
        # UNSPECIFIED: the node's ISERVE_ENGINE; auto takes TensorRT-LLM where it runs.
        (UNSPECIFIED, "auto", True, "cuda", True, {}, "tensorrt_llm"),
        (UNSPECIFIED, "auto", False, "cuda", True, {}, "pytorch"),
        (UNSPECIFIED, "auto", True, "cpu", True, {}, "pytorch"),
        (UNSPECIFIED, "auto", True, "mixed", True, {}, "pytorch"),
        (UNSPECIFIED, "auto", True, "cuda", False, {}, "pytorch"),
        (UNSPECIFIED, "auto", True, "cuda", True, PRUNED, "pytorch"),
        (UNSPECIFIED, "auto", False, "cpu", False, {}, "pytorch"),
        (UNSPECIFIED, "pytorch", True, "cuda", True, {}, "pytorch"),
        (UNSPECIFIED, "tensorrt_llm", True, "cuda", True, {}, "tensorrt_llm"),
        (
            UNSPECIFIED,
            "tensorrt_llm",
            False,
            "cuda",
            True,
            {},
            "FailedPrecondition:ISERVE_ENGINE=tensorrt_llm on this node: tensorrt_llm is not",
        ),
        (
            UNSPECIFIED,
            "tensorrt_llm",
            True,
            "cuda",
            False,
            {},
            "FailedPrecondition:ISERVE_ENGINE=tensorrt_llm on this node: this node runs 2",
        ),
        (UNSPECIFIED, "tensorrt_llm", True, "cpu", True, {}, "FailedPrecondition:NVIDIA GPUs"),
        (UNSPECIFIED, "vllm", True, "cuda", True, {}, "FailedPrecondition:ISERVE_ENGINE must be"),
    ],
)
def test_the_engine_is_the_requests_or_the_nodes_choice(
    models_root, four_layers, monkeypatch, caplog, engine, env, installed, devices, whole, config,
    expected,
):  # fmt: skip
    monkeypatch.setenv("ISERVE_ENGINE", env)
    _installed(monkeypatch, installed)
    request = _group_request(engine, devices, whole, **config)
    if ":" in expected:
        error, message = expected.split(":", 1)
        with pytest.raises({"FailedPrecondition": FailedPrecondition,
                            "InvalidArgument": InvalidArgument}[error], match=message):  # fmt: skip
            _plan(request, models_root)
        return
    with caplog.at_level(logging.INFO, logger="iserve.engine.trtllm"):
        plan = _plan(request, models_root)
    assert plan.engine == expected
    if engine == UNSPECIFIED and env == "auto" and expected == "pytorch":
        # auto says why it did not take TensorRT-LLM.
        assert "the PyTorch engine, not TensorRT-LLM" in caplog.text
    if expected == "pytorch":
        assert plan.processes == plan.workers  # a process per rank, as before
        assert plan.rendezvous_address == request.rendezvous_address
    else:
        assert [w.rank for w in plan.processes] == [0]
        assert plan.rendezvous_address == "" and not plan.needs_rendezvous


def test_a_layer_map_that_does_not_cover_the_model_cannot_map(
    models_root, four_layers, monkeypatch
):
    _installed(monkeypatch, True)
    workers = _ranks(1, 2, [(0, 2), (2, 1)])  # 3 of the 4 layers
    for spec, gpu in zip(workers, GPUS, strict=False):
        spec.device_id = gpu.device_id
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2)
    request = _request(config=config, workers=workers, checkpoint_path=four_layers)
    with pytest.raises(InvalidArgument, match=r"layer map \[2, 1\] must give each"):
        _plan(_with_engine(request, TRTLLM), models_root)
    monkeypatch.setenv("ISERVE_ENGINE", "auto")
    assert _plan(_with_engine(request, UNSPECIFIED), models_root).engine == "pytorch"


def _with_engine(request: agent_pb.StartWorkersRequest, engine: int):
    copy = agent_pb.StartWorkersRequest()
    copy.CopyFrom(request)
    copy.engine = engine
    return copy


@pytest.mark.parametrize(
    ("weight_quant", "flag"),
    [(common.WEIGHT_QUANT_GPTQ_INT4, "gptq-int4"), (common.WEIGHT_QUANT_AWQ_INT4, "awq-int4")],
)
def test_gptq_and_awq_go_to_tensorrt_llm_where_it_runs(
    models_root, four_layers, monkeypatch, weight_quant, flag
):
    monkeypatch.setenv("ISERVE_ENGINE", "auto")
    _installed(monkeypatch, True)
    plan = _plan(_group_request(UNSPECIFIED, weight_quant=weight_quant), models_root)
    assert plan.engine == "tensorrt_llm"
    argv = plan.worker_argv(plan.workers[0], "127.0.0.1", models_root / "ready.json")
    assert argv[argv.index("--weight-quant") + 1] == flag
    # Without TensorRT-LLM the PyTorch engine cannot load them.
    _installed(monkeypatch, False)
    with pytest.raises(Unimplemented, match="GPTQ/AWQ"):
        _plan(_group_request(UNSPECIFIED, weight_quant=weight_quant), models_root)


def _flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}


def test_a_tensorrt_llm_group_is_one_process_with_every_ranks_device(
    models_root, four_layers, monkeypatch
):
    _installed(monkeypatch, True)
    request = _group_request(TRTLLM, kv_quant=common.KV_QUANT_INT8)
    plan = _plan(request, models_root)
    assert plan.engine == "tensorrt_llm" and len(plan.workers) == 4
    [rank0] = plan.processes
    argv = plan.worker_argv(rank0, "127.0.0.1", models_root / "ready.json")
    flags = _flags(argv)
    assert flags["--engine"] == "tensorrt_llm"
    assert flags["--rank"] == "0" and flags["--world-size"] == "4"
    assert (flags["--tensor-parallel"], flags["--pipeline-parallel"]) == ("2", "2")
    assert flags["--group-devices"] == "0,1,2,3"  # rank order
    assert flags["--stage-layers"] == "3,1"
    assert flags["--device"] == "cuda:0"
    assert flags["--cores"] == "0,1,2,3"  # every rank's cores: its rank processes inherit them
    assert flags["--kv-quant"] == "int8"
    assert not {"--rendezvous", "--first-layer", "--layer-count", "--time-layers"} & set(argv)
    # The worker accepts it as the group's rank 0 (tensorrt_llm found, CUDA devices).
    from monitor_agent.worker.process import check_args, parse_args

    monkeypatch.setattr(
        "monitor_agent.engine.trtllm.selection.tensorrt_llm_installed", lambda: True
    )
    args = parse_args(argv[3:])
    assert check_args(args) == [0, 1, 2, 3]
    assert args.engine == "tensorrt_llm"
    from monitor_agent.worker.process import trtllm_config

    config = trtllm_config(args)
    assert config.devices == (0, 1, 2, 3) and config.stage_layers == (3, 1)
    assert config.kv_cache_dtype == "int8"


def test_a_tensorrt_llm_group_of_one_stage_gives_no_layer_map(models_root, monkeypatch):
    _installed(monkeypatch, True)
    workers = [
        agent_pb.WorkerSpec(rank=r, device_id=f"cuda{3 - r}", tensor_rank=r) for r in range(2)
    ]
    config = common.DeploymentConfig(tensor_parallel=2)
    plan = _plan(_request(config=config, workers=workers, engine=TRTLLM), models_root)
    flags = _flags(plan.worker_argv(plan.processes[0], "127.0.0.1", models_root / "r.json"))
    assert flags["--group-devices"] == "3,2" and "--stage-layers" not in flags
    assert flags["--device"] == "cuda:3"


def test_the_pytorch_engine_is_named_on_each_ranks_command_line(models_root, four_layers):
    # The agent decides; a worker does not decide again from ISERVE_ENGINE.
    plan = _plan(_group_request(PYTORCH, devices="cpu"), models_root)
    for worker in plan.workers:
        argv = plan.worker_argv(worker, "127.0.0.1", models_root / "r.json")
        assert _flags(argv)["--engine"] == "pytorch" and "--group-devices" not in argv


def test_a_checkpoint_rewritten_as_another_model_is_refused(models_root):
    """The deployer sends the model's registered shape; the checkpoint on this node must
    still be that model (the memory reserved was for that shape). A config that does not
    parse, or a request without a shape, is not checked here."""
    from services.api import model_service_pb2 as model_pb
    from services.models.checkpoint import create_checkpoint

    create_checkpoint(
        models_root / "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2
    )
    registered = model_pb.ModelShape(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=json.loads((models_root / "llama" / "config.json").read_text())[
            "intermediate_size"
        ],
        vocab_size=json.loads((models_root / "llama" / "config.json").read_text())["vocab_size"],
    )
    _plan(_request(checkpoint_path="llama", expected_shape=registered), models_root)
    _plan(_request(checkpoint_path="llama"), models_root)
    wider = model_pb.ModelShape()
    wider.CopyFrom(registered)
    wider.hidden_size = 128  # registered wider than the checkpoint is now
    with pytest.raises(FailedPrecondition) as refused:
        _plan(_request(checkpoint_path="llama", expected_shape=wider), models_root)
    assert str(refused.value) == (
        "checkpoint 'llama' is no longer the model registered from it: its checkpoint has "
        "hidden_size 64, the model has 128; register it again (as a new model id, or after "
        "`iserve model delete`)"
    )
    fewer_heads = model_pb.ModelShape()
    fewer_heads.CopyFrom(registered)
    fewer_heads.num_kv_heads = 1
    with pytest.raises(FailedPrecondition, match="num_kv_heads 2, more than the model's 1"):
        _plan(_request(checkpoint_path="llama", expected_shape=fewer_heads), models_root)
    # "tiny" has a config that describes no model: left to the worker to explain.
    _plan(_request(expected_shape=wider), models_root)


def test_an_agent_refuses_workers_placed_on_another_node(tmp_path):
    """Two nodes' agents given one address: one node's workers ran on the other, its
    memory accounted to the wrong node, and nothing said so (a multi-host probe)."""
    import asyncio

    from monitor_agent.servicer import AgentServicer
    from services.errors import FailedPrecondition
    from services.settings import load_settings

    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_NODE_ID": "c0"})
    servicer = AgentServicer(settings, [], supervisor=None)
    request = agent_pb.StartWorkersRequest(deployment_id="d", node_id="n2")
    with pytest.raises(FailedPrecondition, match="placed on node n2 reached the agent of node c0"):
        asyncio.run(servicer.StartWorkers(request, None))
    # A node id no node has is refused as such, shown cut and escaped: a probe's
    # "a\nb" wrote a line of its own into the agent's log, a megabyte one two.
    for hostile in ("a\nb INFO fake", "n\x00", "n" * 1_000_000):
        request = agent_pb.StartWorkersRequest(deployment_id="d", node_id=hostile)
        with pytest.raises(InvalidArgument, match="invalid node_id ") as refused:
            asyncio.run(servicer.StartWorkers(request, None))
        assert "\n" not in str(refused.value) and len(str(refused.value)) < 300


@pytest.mark.parametrize("deployment_id", ["", "a b", "x" * 100_000, "../etc"])
def test_stop_and_list_workers_refuse_a_malformed_deployment_id(deployment_id):
    """A fuzzing tester's malformed ids were taken (and a megabyte one echoed); they name
    no workers. ListWorkers' empty id is every deployment's."""
    import asyncio

    from monitor_agent.servicer import AgentServicer

    calls = []

    class Supervisor:
        async def stop_workers(self, deployment_id, lost_rank=False):
            calls.append(deployment_id)
            return []

        def list_workers(self, deployment_id=""):
            calls.append(deployment_id)
            return []

    servicer = AgentServicer(None, [], Supervisor())
    with pytest.raises(InvalidArgument, match="invalid deployment_id"):
        asyncio.run(
            servicer.StopWorkers(agent_pb.StopWorkersRequest(deployment_id=deployment_id), None)
        )
    request = agent_pb.ListWorkersRequest(deployment_id=deployment_id)
    if deployment_id:
        with pytest.raises(InvalidArgument, match="invalid deployment_id"):
            asyncio.run(servicer.ListWorkers(request, None))
        assert calls == []
    else:
        asyncio.run(servicer.ListWorkers(request, None))
        assert calls == [""]


def test_a_worker_whose_agent_died_drains_only_until_its_memory_is_given_away(monkeypatch):
    """Its agent SIGKILLed, a worker drained its streams for up to 30 s while the
    deployer, the agent's heartbeat lapsed (5 s), had released its memory for others (a
    tester). The parent watch says so before its SIGTERM, and the drain then lasts at
    most the heartbeat's lifetime."""
    import asyncio
    import os
    import signal

    from monitor_agent.worker import process

    assert process.drain_budget(30.0, group_lost=False, orphaned=False, heartbeat_ttl_s=5.0) == 30.0
    assert process.drain_budget(30.0, group_lost=False, orphaned=True, heartbeat_ttl_s=5.0) == 5.0
    assert process.drain_budget(2.0, group_lost=False, orphaned=True, heartbeat_ttl_s=5.0) == 2.0
    lost = process.drain_budget(30.0, group_lost=True, orphaned=True, heartbeat_ttl_s=5.0)
    assert lost == process.LOST_GROUP_DRAIN_S

    said, signalled = [], []
    monkeypatch.setattr(process.os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    watch = process.parent_watch(os.getppid() + 1, lambda: said.append("orphaned"))
    asyncio.run(watch())  # not its parent: at once
    assert said == ["orphaned"] and signalled == [(os.getpid(), signal.SIGTERM)]


def test_start_workers_reads_the_checkpoint_beside_the_event_loop(monkeypatch, models_root):
    """build_plan reads the checkpoint's config and weight headers: on a slow disk, done on
    the agent's event loop, it held the heartbeat and every other call."""
    import asyncio
    import threading

    from monitor_agent import servicer as agent_servicer

    seen = {}

    def plan(request, **_):
        seen["thread"] = threading.get_ident()
        raise InvalidArgument("no plan")

    monkeypatch.setattr(agent_servicer, "build_plan", plan)
    settings = types.SimpleNamespace(models_root=models_root, ready_timeout_s=5.0, node_id="n")
    agent = agent_servicer.AgentServicer(settings, list(DEVICES.values()), supervisor=None)

    async def call():
        seen["loop"] = threading.get_ident()
        with pytest.raises(InvalidArgument, match="no plan"):
            await agent.StartWorkers(_request(), context=None)

    asyncio.run(call())
    assert seen["thread"] != seen["loop"]
