"""What the agent launches: a validated plan built from a StartWorkersRequest.

The servicer turns the request into a :class:`LaunchPlan` (checking everything a caller
can get wrong); the supervisor turns a plan into processes. Keeping the plan a plain
dataclass lets tests drive the supervisor without protobufs or gRPC.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from monitor_agent.devices import DeviceSpec
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.engine_rules import (
    TENSOR_PARALLEL_DEGREES,
    check_dtype,
    check_weight_quant,
    resolve_checkpoint,
)
from services.errors import FailedPrecondition, InvalidArgument, Unimplemented, require
from services.ids import check_deployment_id
from services.models.checkpoint import InvalidCheckpoint, read_config
from services.models.compression import DEFAULT_PRUNE_FRACTION

DEFAULT_MAX_SEQ_LEN = 2048
_DTYPES = {
    common.PRECISION_FLOAT32: "float32",
    common.PRECISION_FLOAT16: "float16",
    common.PRECISION_BFLOAT16: "bfloat16",
}
# DeploymentConfig compression -> the worker's --weight-quant / --kv-quant / --pruning.
_WEIGHT_QUANTS = {
    common.WEIGHT_QUANT_UNSPECIFIED: "none",
    common.WEIGHT_QUANT_NONE: "none",
    common.WEIGHT_QUANT_INT8: "int8",
    common.WEIGHT_QUANT_INT4: "int4",
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

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def worker_argv(self, worker: WorkerPlan, host: str, ready_file: Path) -> list[str]:
        """Command line of ``worker``'s process."""
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
            "--port", "0",
            "--ready-file", str(ready_file),
            "--parent-pid", str(os.getpid()),
            *self.compression_args,
            *(["--time-layers"] if self.time_layers else []),
        ]  # fmt: skip


def worker_dtype(precision: int, device: DeviceSpec, checkpoint_dtype: str | None) -> str:
    """The dtype a worker computes in: the requested precision (Unimplemented where the
    engine does not compute in it on ``device``), else the checkpoint's dtype on GPUs and
    float32 on CPU devices (where 16-bit matmuls are slow)."""
    if precision in _DTYPES:
        check_dtype(precision, cuda=device.is_cuda)
        return _DTYPES[precision]
    require(
        precision == common.PRECISION_UNSPECIFIED, f"config.dtype {precision} is not a known value"
    )
    if device.is_cuda and checkpoint_dtype in _DTYPES.values():
        return checkpoint_dtype
    return "float32"


def check_engine(engine: int) -> None:
    """Only the PyTorch engine runs here; TensorRT-LLM needs its package (and a GPU)."""
    if engine == agent_pb.ENGINE_KIND_PYTORCH:
        return
    if engine == agent_pb.ENGINE_KIND_TENSORRT_LLM:
        if importlib.util.find_spec("tensorrt_llm") is None:
            raise FailedPrecondition(
                "engine TENSORRT_LLM is not available on this node: tensorrt_llm is not installed"
            )
        raise Unimplemented("the TensorRT-LLM worker is not implemented yet")
    raise InvalidArgument("engine must be ENGINE_KIND_PYTORCH or ENGINE_KIND_TENSORRT_LLM")


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


def compression_args(config: common.DeploymentConfig) -> tuple[str, ...]:
    """The worker flags that apply ``config``'s weight quantization, KV-cache quantization
    and pruning (none for an uncompressed config). Unimplemented for pre-quantized
    GPTQ/AWQ checkpoints, which the PyTorch engine does not load; InvalidArgument for
    values outside the enums."""
    check_weight_quant(config.weight_quant)
    for field, known in (
        ("weight_quant", _WEIGHT_QUANTS),
        ("kv_quant", _KV_QUANTS),
        ("pruning", _PRUNINGS),
    ):
        value = getattr(config, field)
        require(value in known, f"config.{field} {value} is not a known value")
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
) -> LaunchPlan:
    """Validate ``request`` against this node and turn it into a LaunchPlan.

    Raises InvalidArgument for malformed requests (unknown devices, a checkpoint outside
    the models root, duplicate ranks, ranks or layers that do not form a tp × pp group)
    and FailedPrecondition for requests this node cannot serve (TensorRT-LLM without its
    package, GPTQ/AWQ weights).
    """
    deployment_id = request.deployment_id
    check_deployment_id(deployment_id)
    require(len(request.workers) > 0, "workers is empty: give at least one WorkerSpec")
    ranks = [w.rank for w in request.workers]
    require(len(set(ranks)) == len(ranks), f"workers repeat a rank: {sorted(ranks)}")
    for spec in request.workers:
        require(
            spec.device_id in devices,
            f"worker rank {spec.rank}: device {spec.device_id!r} is not on this node "
            f"(devices: {', '.join(devices)})",
        )
    check_engine(request.engine)
    tp, pp = check_config(request.config)
    compression = compression_args(request.config)
    checkpoint_dir = resolve_checkpoint(models_root, request.checkpoint_path)
    config = _checkpoint_config(checkpoint_dir)
    num_layers = config.get("num_hidden_layers") or config.get("n_layer")
    check_ranks(
        list(request.workers),
        tp,
        pp,
        num_layers if isinstance(num_layers, int) else None,
        request.rendezvous_address,
    )
    workers = tuple(
        WorkerPlan(w.rank, devices[w.device_id], w.first_layer, w.layer_count)
        for w in request.workers
    )
    max_positions = int(config.get("max_position_embeddings") or DEFAULT_MAX_SEQ_LEN)
    ready_timeout_s = (
        request.ready_timeout_ms / 1000 if request.ready_timeout_ms else default_ready_timeout_s
    )
    return LaunchPlan(
        deployment_id=deployment_id,
        checkpoint_dir=checkpoint_dir,
        dtype=worker_dtype(
            request.config.dtype,
            workers[0].device,
            config.get("torch_dtype") or config.get("dtype"),
        ),
        max_seq_len=request.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, max_positions),
        max_batch=request.config.batch_size or 1,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        workers=workers,
        ready_timeout_s=ready_timeout_s,
        compression_args=compression,
        rendezvous_address=request.rendezvous_address,
    )


def _checkpoint_config(checkpoint_dir: Path) -> dict:
    """The checkpoint's config.json, or {} when unreadable (the worker then reports why)."""
    try:
        return read_config(checkpoint_dir)
    except InvalidCheckpoint:
        return {}
