"""What the agent launches: a validated plan built from a StartWorkersRequest.

The servicer turns the request into a :class:`LaunchPlan` (checking everything a caller
can get wrong); the supervisor turns a plan into processes. Keeping the plan a plain
dataclass lets tests drive the supervisor without protobufs or gRPC.

The plan also records the engine (:func:`monitor_agent.launch_engine.resolve_engine`:
the request's engine, or for ``ENGINE_KIND_UNSPECIFIED`` this node's ``ISERVE_ENGINE``,
read against the node's devices and package). A PyTorch group is one process per rank; a
TensorRT-LLM group is one process, rank 0's, which runs every rank
(:attr:`LaunchPlan.processes`).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from monitor_agent.devices import DeviceSpec
from monitor_agent.engine.trtllm.mapping import TrtLlmConfig
from monitor_agent.engine.trtllm.selection import PYTORCH, TENSORRT_LLM
from monitor_agent.launch_engine import resolve_engine
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.engine_rules import (
    TENSOR_PARALLEL_DEGREES,
    check_dtype,
    check_still_the_model,
    check_weight_quant,
    check_weights_still_the_model,
    default_dtype,
    even_stage_layers,
    pipeline_parallel_problem,
    resolve_checkpoint,
)
from services.errors import FailedPrecondition, InvalidArgument, require
from services.ids import check_deployment_id, check_node_id
from services.models.checkpoint import InvalidCheckpoint, read_config
from services.models.compression import DEFAULT_PRUNE_FRACTION
from services.models.errors import InvalidConfig, UnsupportedArchitecture
from services.models.families import parse_config
from services.token_limits import check_batch_size

log = logging.getLogger("iserve.agent.launch")

DEFAULT_MAX_SEQ_LEN = 2048
_DTYPES = {
    common.PRECISION_FLOAT32: "float32",
    common.PRECISION_FLOAT16: "float16",
    common.PRECISION_BFLOAT16: "bfloat16",
}
# DeploymentConfig compression -> the worker's --weight-quant / --kv-quant / --pruning
# (GPTQ/AWQ with the TensorRT-LLM engine only).
_WEIGHT_QUANTS = {
    common.WEIGHT_QUANT_UNSPECIFIED: "none",
    common.WEIGHT_QUANT_NONE: "none",
    common.WEIGHT_QUANT_INT8: "int8",
    common.WEIGHT_QUANT_INT4: "int4",
    common.WEIGHT_QUANT_GPTQ_INT4: "gptq-int4",
    common.WEIGHT_QUANT_AWQ_INT4: "awq-int4",
}
_KV_QUANTS = {
    common.KV_QUANT_UNSPECIFIED: "none",
    common.KV_QUANT_NONE: "none",
    common.KV_QUANT_INT8: "int8",
}
_PRUNINGS = {
    common.PRUNING_UNSPECIFIED: "none",
    common.PRUNING_NONE: "none",
    common.PRUNING_SEMI_STRUCTURED_2_4: "2:4",
    common.PRUNING_STRUCTURED: "structured",
}


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    device: DeviceSpec
    # The pipeline stage's layers; layer_count 0 means to the last layer.
    first_layer: int = 0
    layer_count: int = 0


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start the workers of one deployment on this node."""

    deployment_id: str
    checkpoint_dir: Path
    dtype: str
    max_seq_len: int
    max_batch: int
    tensor_parallel: int
    pipeline_parallel: int
    workers: tuple[WorkerPlan, ...]
    ready_timeout_s: float
    # --weight-quant/--kv-quant/--pruning flags from compression_args(); empty: none.
    compression_args: tuple[str, ...] = ()
    # host:port of the torch.distributed store with tp·pp > 1; the supervisor picks one
    # on this node when it is empty and the node runs every rank.
    rendezvous_address: str = ""
    # Workers keep a layer clock (profiling jobs; see monitor_agent.engine.model).
    time_layers: bool = False
    # With time_layers: the layers of the full model this checkpoint's layers stand for
    # (a fingerprint's; 0: the checkpoint's own). Each worker is told its stage's share
    # (--footprint-layers), which its clock times the stage's layers with the cache
    # footprint of (monitor_agent.engine.footprint).
    footprint_model_layers: int = 0
    # Seconds the workers' records in Redis outlive their last write (0: until they are
    # stopped): a profiling job's, deleted when it ends, would stay for good after its
    # agent was killed mid-job (no one else knows its group).
    records_expire_s: float = 0.0
    # The engine the workers run: "pytorch" (a process per rank) or "tensorrt_llm" (one
    # process, rank 0's, for the whole group, which this node then runs entirely).
    engine: str = PYTORCH

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def processes(self) -> tuple[WorkerPlan, ...]:
        """The workers that get a process of their own: every rank with the PyTorch
        engine; rank 0 alone with TensorRT-LLM, whose process hosts the other ranks."""
        if self.engine == TENSORRT_LLM:
            return tuple(w for w in self.workers if w.rank == 0)
        return self.workers

    @property
    def needs_rendezvous(self) -> bool:
        """Whether the ranks meet at a torch.distributed store (PyTorch, tp·pp > 1)."""
        return self.engine == PYTORCH and self.world_size > 1

    def worker_argv(
        self, worker: WorkerPlan, host: str, ready_file: Path, port: int = 0
    ) -> list[str]:
        """Command line of ``worker``'s process (one of :attr:`processes`), serving on
        ``port`` (0: a free one the process picks)."""
        if self.engine == TENSORRT_LLM:
            return self._group_argv(worker, host, ready_file, port)
        return [
            sys.executable,
            "-m",
            "monitor_agent.worker",
            "--deployment-id", self.deployment_id,
            "--rank", str(worker.rank),
            "--tensor-parallel", str(self.tensor_parallel),
            "--pipeline-parallel", str(self.pipeline_parallel),
            "--world-size", str(self.world_size),
            *(
                ["--first-layer", str(worker.first_layer), "--layer-count", str(worker.layer_count)]
                if self.pipeline_parallel > 1
                else []
            ),
            *(["--rendezvous", self.rendezvous_address] if self.rendezvous_address else []),
            "--checkpoint", str(self.checkpoint_dir),
            "--dtype", self.dtype,
            "--max-seq-len", str(self.max_seq_len),
            "--max-batch", str(self.max_batch),
            "--device", worker.device.torch_device,
            "--cores", ",".join(str(c) for c in worker.device.cpu_cores),
            "--host", host,
            "--port", str(port),
            "--ready-file", str(ready_file),
            "--parent-pid", str(os.getpid()),
            "--engine", PYTORCH,
            *self.compression_args,
            *(["--time-layers"] if self.time_layers else []),
            *self._footprint_args(worker),
        ]  # fmt: skip

    def _footprint_args(self, worker: WorkerPlan) -> list[str]:
        """``--footprint-layers`` for ``worker``: its stage's share of the full model's
        layers, split as a deployment splits them; none unless the plan has a model."""
        model_layers = self.footprint_model_layers
        if not (self.time_layers and model_layers >= self.pipeline_parallel):
            return []
        stage = worker.rank // self.tensor_parallel
        share = even_stage_layers(model_layers, self.pipeline_parallel)[stage]
        return ["--footprint-layers", str(share)]

    def _group_argv(
        self, worker: WorkerPlan, host: str, ready_file: Path, port: int = 0
    ) -> list[str]:
        """Rank 0's command line for a TensorRT-LLM group: every rank's device in rank
        order and each stage's layer count; no rendezvous (TensorRT-LLM forms the group).
        It pins to the cores of every device of the group, which the rank processes
        TensorRT-LLM starts inherit."""
        assert worker.rank == 0, "a TensorRT-LLM group runs from rank 0's process"
        cores = sorted({c for w in self.workers for c in w.device.cpu_cores})
        stages = layers_per_stage(self.workers, self.tensor_parallel)
        return [
            sys.executable,
            "-m",
            "monitor_agent.worker",
            "--deployment-id", self.deployment_id,
            "--rank", "0",
            "--tensor-parallel", str(self.tensor_parallel),
            "--pipeline-parallel", str(self.pipeline_parallel),
            "--world-size", str(self.world_size),
            "--checkpoint", str(self.checkpoint_dir),
            "--dtype", self.dtype,
            "--max-seq-len", str(self.max_seq_len),
            "--max-batch", str(self.max_batch),
            "--device", worker.device.torch_device,
            "--cores", ",".join(str(c) for c in cores),
            "--host", host,
            "--port", str(port),
            "--ready-file", str(ready_file),
            "--parent-pid", str(os.getpid()),
            "--engine", TENSORRT_LLM,
            "--group-devices", ",".join(str(i) for i in group_devices(self.workers)),
            *(
                ["--stage-layers", ",".join(str(n) for n in stages)]
                if self.pipeline_parallel > 1
                else []
            ),
            *self.compression_args,
        ]  # fmt: skip


def group_devices(workers: tuple[WorkerPlan, ...]) -> tuple[int, ...]:
    """The CUDA index of every rank's device, in rank order (-1 for a non-CUDA device,
    which TensorRT-LLM refuses before this is used)."""
    ordered = sorted(workers, key=lambda w: w.rank)
    return tuple(-1 if w.device.cuda_index is None else w.device.cuda_index for w in ordered)


def layers_per_stage(workers: tuple[WorkerPlan, ...], tensor_parallel: int) -> tuple[int, ...]:
    """Each pipeline stage's layer count, stage by stage (rank = stage·tp + tensor rank),
    for workers whose stages check_ranks found consistent."""
    by_stage = {w.rank // tensor_parallel: w.layer_count for w in workers}
    return tuple(by_stage[stage] for stage in sorted(by_stage))


def worker_dtype(precision: int, device: DeviceSpec, checkpoint_dtype: str | None) -> str:
    """The dtype a worker computes in: the requested precision (Unimplemented where the
    engine does not compute in it on ``device``), else engine_rules.default_dtype's for
    the checkpoint's dtype (a config-style name, None when the config names none)."""
    if precision in _DTYPES:
        check_dtype(precision, cuda=device.is_cuda)
        return _DTYPES[precision]
    require(
        precision == common.PRECISION_UNSPECIFIED, f"config.dtype {precision} is not a known value"
    )
    stored = next((p for p, name in _DTYPES.items() if name == checkpoint_dtype), 0)
    return _DTYPES[default_dtype(stored, cuda=device.is_cuda)]


def check_config(config: common.DeploymentConfig) -> tuple[int, int]:
    """(tp, pp) of ``config`` (0 read as 1); InvalidArgument for a degree workers cannot run."""
    tp, pp = config.tensor_parallel or 1, config.pipeline_parallel or 1
    require(
        tp in TENSOR_PARALLEL_DEGREES,
        f"config.tensor_parallel must be one of {TENSOR_PARALLEL_DEGREES}, got {tp}",
    )
    return tp, pp


def check_ranks(
    workers: list[agent_pb.WorkerSpec], tp: int, pp: int, num_layers: int | None, rendezvous: str
) -> None:
    """InvalidArgument unless ``workers`` are ranks of a tp × pp group (rank = stage·tp +
    tensor_rank), the ranks of a stage on this node agree on its layers, the layers lie
    within the model's ``num_layers`` (when known), and a ``rendezvous`` address is given
    when this node runs only some of the ranks."""
    world = tp * pp
    stage_layers: dict[int, tuple[int, int]] = {}
    for spec in workers:
        require(
            spec.rank < world,
            f"worker rank {spec.rank} is outside 0..{world - 1} (tp·pp = {world})",
        )
        stage, tensor_rank = divmod(spec.rank, tp)
        if world > 1:
            require(
                (spec.stage, spec.tensor_rank) == (stage, tensor_rank),
                f"worker rank {spec.rank} must be stage {stage} tensor rank {tensor_rank} "
                f"(rank = stage·tp + tensor_rank), got stage {spec.stage} "
                f"tensor rank {spec.tensor_rank}",
            )
        if pp > 1:
            require(
                spec.layer_count > 0,
                f"worker rank {spec.rank}: layer_count is required with pipeline_parallel {pp}",
            )
        last = spec.first_layer + spec.layer_count
        if num_layers is not None:
            require(
                last <= num_layers and spec.first_layer < num_layers,
                f"worker rank {spec.rank}: layers [{spec.first_layer}, {last}) are outside "
                f"the model's {num_layers} layers",
            )
        layers = (spec.first_layer, spec.layer_count)
        require(
            stage_layers.setdefault(stage, layers) == layers,
            f"the ranks of stage {stage} give different layers: {stage_layers[stage]} and {layers}",
        )
    require(
        bool(rendezvous) or len(workers) == world,
        f"rendezvous_address is required: this node runs {len(workers)} of the {world} ranks",
    )


def check_compression(config: common.DeploymentConfig) -> None:
    """InvalidArgument for compression values outside the enums."""
    for field, known in (
        ("weight_quant", _WEIGHT_QUANTS),
        ("kv_quant", _KV_QUANTS),
        ("pruning", _PRUNINGS),
    ):
        value = getattr(config, field)
        require(value in known, f"config.{field} {value} is not a known value")


def compression_args(config: common.DeploymentConfig, engine: str = PYTORCH) -> tuple[str, ...]:
    """The worker flags that apply ``config``'s weight quantization, KV-cache quantization
    and pruning (none for an uncompressed config). With the PyTorch engine, Unimplemented
    for pre-quantized GPTQ/AWQ checkpoints, which it does not load; InvalidArgument for
    values outside the enums."""
    check_compression(config)
    if engine == PYTORCH:
        check_weight_quant(config.weight_quant)
    args: list[str] = []
    for flag, value in (
        ("--weight-quant", _WEIGHT_QUANTS[config.weight_quant]),
        ("--kv-quant", _KV_QUANTS[config.kv_quant]),
        ("--pruning", _PRUNINGS[config.pruning]),
    ):
        if value != "none":
            args += [flag, value]
    if config.pruning == common.PRUNING_STRUCTURED:
        # A DeploymentConfig does not carry its variant's structured_prune_fraction, so
        # every structured deployment drops the default share.
        args += ["--prune-fraction", str(DEFAULT_PRUNE_FRACTION)]
    return tuple(args)


def build_plan(
    request: agent_pb.StartWorkersRequest,
    *,
    devices: dict[str, DeviceSpec],
    models_root: Path,
    default_ready_timeout_s: float,
    node_engine_choice: str | None = None,
    tensorrt_llm_installed: bool | None = None,
    node_id: str = "",
) -> LaunchPlan:
    """Validate ``request`` against this node (``node_id``: its id, which a request that
    names its node must name) and turn it into a LaunchPlan.

    Raises CheckpointUnusable (an InvalidArgument) for a checkpoint path that names no
    checkpoint under the models root and CheckpointChanged (a FailedPrecondition) for a
    checkpoint rewritten as another model since it was registered; InvalidArgument for
    other malformed requests (unknown devices, duplicate ranks, ranks or layers that do
    not form a tp × pp group, a configuration TensorRT-LLM cannot map when it was asked
    for), FailedPrecondition for
    requests this node cannot serve (TensorRT-LLM asked for without its package, on a
    device that is not a CUDA GPU, or for part of a group) and Unimplemented for GPTQ/AWQ
    weights on the PyTorch engine. The engine is
    :func:`monitor_agent.launch_engine.resolve_engine`'s, ``node_engine_choice``
    (default ``ISERVE_ENGINE``) and ``tensorrt_llm_installed`` (default: look for the
    package) standing for this node.
    """
    if request.node_id:
        check_node_id(request.node_id)  # it is logged and echoed below
    if request.node_id and node_id and request.node_id != node_id:
        raise FailedPrecondition(
            f"workers placed on node {request.node_id} reached the agent of node {node_id}: "
            f"the address the deployer has for node {request.node_id} is this agent's (set "
            "each node's ISERVE_AGENT_ADDR to an address only its own agent serves)"
        )
    deployment_id = request.deployment_id
    check_deployment_id(deployment_id)
    require(len(request.workers) > 0, "workers is empty: give at least one WorkerSpec")
    tp, pp = check_config(request.config)
    require(
        len(request.workers) <= tp * pp,
        f"{len(request.workers)} workers for a group of tp {tp} x pp {pp}",
    )
    check_batch_size(request.config.batch_size, "config.batch_size")
    ranks = [w.rank for w in request.workers]
    require(len(set(ranks)) == len(ranks), f"workers repeat a rank: {sorted(ranks)}")
    for spec in request.workers:
        require(
            spec.device_id in devices,
            f"worker rank {spec.rank}: device {spec.device_id!r} is not on this node "
            f"(devices: {', '.join(devices)})",
        )
    check_compression(request.config)
    checkpoint_dir = resolve_checkpoint(models_root, request.checkpoint_path)
    config = _checkpoint_config(checkpoint_dir)
    if request.HasField("expected_shape"):
        check_still_the_model(request.checkpoint_path, config, request.expected_shape)
        check_weights_still_the_model(request.checkpoint_path, checkpoint_dir, config)
    num_layers = _positive_int(config, "num_hidden_layers", "n_layer")
    # A fuzzing tester's pp of 1000 started a worker that waited for peers that cannot exist.
    problem = pipeline_parallel_problem(pp, num_layers)
    if problem:
        raise InvalidArgument(f"config.{problem}")
    check_ranks(list(request.workers), tp, pp, num_layers, request.rendezvous_address)
    workers = tuple(
        WorkerPlan(w.rank, devices[w.device_id], w.first_layer, w.layer_count)
        for w in request.workers
    )
    max_positions = _max_positions(config)
    # The worker would refuse it at start-up and exit: say so before starting it.
    require(
        max_positions is None or request.max_seq_len <= max_positions,
        f"max_seq_len {request.max_seq_len} (the longest prompt + output a sequence holds) "
        f"exceeds the model's {max_positions} positions (max_position_embeddings)",
    )
    ready_timeout_s = (
        request.ready_timeout_ms / 1000 if request.ready_timeout_ms else default_ready_timeout_s
    )
    plan = LaunchPlan(
        deployment_id=deployment_id,
        checkpoint_dir=checkpoint_dir,
        dtype=worker_dtype(
            request.config.dtype,
            workers[0].device,
            config.get("torch_dtype") or config.get("dtype"),
        ),
        max_seq_len=request.max_seq_len
        or min(DEFAULT_MAX_SEQ_LEN, max_positions or DEFAULT_MAX_SEQ_LEN),
        max_batch=request.config.batch_size or 1,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        workers=workers,
        ready_timeout_s=ready_timeout_s,
        rendezvous_address=request.rendezvous_address,
    )
    engine = resolve_engine(
        request.engine,
        trtllm_config(plan, request.config),
        devices=[w.device for w in workers],
        node_ranks=len(workers),
        num_layers=num_layers,
        node_choice=node_engine_choice,
        installed=tensorrt_llm_installed,
    )
    log.info("deployment %s: the %s engine", deployment_id, engine)
    return replace(
        plan,
        engine=engine,
        compression_args=compression_args(request.config, engine),
        # TensorRT-LLM forms its group itself, inside rank 0's process.
        rendezvous_address=request.rendezvous_address if engine == PYTORCH else "",
    )


def trtllm_config(plan: LaunchPlan, config: common.DeploymentConfig) -> TrtLlmConfig:
    """What TensorRT-LLM would be asked to run for ``plan`` (its compression from
    ``config``, whose values check_compression accepted)."""
    kv_quant = _KV_QUANTS[config.kv_quant]
    return TrtLlmConfig(
        checkpoint_dir=plan.checkpoint_dir,
        devices=group_devices(plan.workers),
        dtype=plan.dtype,
        max_seq_len=plan.max_seq_len,
        max_batch=plan.max_batch,
        tensor_parallel=plan.tensor_parallel,
        pipeline_parallel=plan.pipeline_parallel,
        stage_layers=(
            layers_per_stage(plan.workers, plan.tensor_parallel)
            if plan.pipeline_parallel > 1
            else ()
        ),
        weight_quant=_WEIGHT_QUANTS[config.weight_quant],
        kv_cache_dtype=None if kv_quant == "none" else kv_quant,
        pruning=_PRUNINGS[config.pruning],
    )


def _max_positions(config: dict) -> int | None:
    """The positions the model of ``config`` holds, read as its family reads them (GPT-J
    names them n_positions), or None when unknown (the worker then reports why)."""
    try:
        return parse_config(config).max_position_embeddings
    except (InvalidConfig, UnsupportedArchitecture):
        return _positive_int(config, "max_position_embeddings", "n_positions")


def _positive_int(config: dict, *names: str) -> int | None:
    """The first of ``names`` that ``config`` gives as a positive integer, else None."""
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _checkpoint_config(checkpoint_dir: Path) -> dict:
    """The checkpoint's config.json, or {} when unreadable (the worker then reports why)."""
    try:
        return read_config(checkpoint_dir)
    except InvalidCheckpoint:
        return {}
