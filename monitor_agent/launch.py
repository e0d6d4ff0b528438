"""What the agent launches: a validated plan built from a StartWorkersRequest.

The servicer turns the request into a :class:`LaunchPlan` (checking everything a caller
can get wrong); the supervisor turns a plan into processes. Keeping the plan a plain
dataclass lets tests drive the supervisor without protobufs or gRPC.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from monitor_agent.devices import DeviceSpec
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.errors import FailedPrecondition, InvalidArgument, Unimplemented, require
from services.models.checkpoint import InvalidCheckpoint, read_config

DEFAULT_MAX_SEQ_LEN = 2048
# Deployment ids become Redis key parts and file names.
_DEPLOYMENT_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_DTYPES = {
    common.PRECISION_FLOAT32: "float32",
    common.PRECISION_FLOAT16: "float16",
    common.PRECISION_BFLOAT16: "bfloat16",
}


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    device: DeviceSpec


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
        ]  # fmt: skip


def resolve_checkpoint(models_root: Path, checkpoint_path: str) -> Path:
    """``checkpoint_path`` under ``models_root``; InvalidArgument if it leaves the root
    (through ``..`` or a symlink) or is not a directory."""
    require(bool(checkpoint_path), "checkpoint_path is empty")
    root = models_root.resolve()
    resolved = (root / checkpoint_path).resolve()
    require(
        resolved.is_relative_to(root),
        f"checkpoint_path {checkpoint_path!r} resolves outside the models root {str(root)!r}",
    )
    require(
        resolved.is_dir(),
        f"checkpoint_path {checkpoint_path!r} is not a directory under the models root",
    )
    return resolved


def worker_dtype(precision: int, device: DeviceSpec, checkpoint_dtype: str | None) -> str:
    """The dtype a worker computes in: the requested precision, else the checkpoint's
    dtype on GPUs and float32 on CPU devices (where 16-bit matmuls are slow)."""
    if precision in _DTYPES:
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
    """(tp, pp) of ``config`` (0 read as 1); FailedPrecondition for what workers cannot run."""
    tp, pp = config.tensor_parallel or 1, config.pipeline_parallel or 1
    if tp * pp != 1:
        raise FailedPrecondition(
            f"tensor_parallel={tp} pipeline_parallel={pp}: workers on this node run "
            "tp = pp = 1 only for now"
        )
    unsupported = [
        name
        for name, value, none in (
            ("weight_quant", config.weight_quant, common.WEIGHT_QUANT_NONE),
            ("kv_quant", config.kv_quant, common.KV_QUANT_NONE),
            ("pruning", config.pruning, common.PRUNING_NONE),
        )
        if value not in (0, none)
    ]
    if unsupported:
        raise FailedPrecondition(
            f"the PyTorch engine does not apply {', '.join(unsupported)} yet; "
            "deploy the uncompressed configuration"
        )
    return tp, pp


def build_plan(
    request: agent_pb.StartWorkersRequest,
    *,
    devices: dict[str, DeviceSpec],
    models_root: Path,
    default_ready_timeout_s: float,
) -> LaunchPlan:
    """Validate ``request`` against this node and turn it into a LaunchPlan.

    Raises InvalidArgument for malformed requests (unknown devices, a checkpoint outside
    the models root, duplicate ranks) and FailedPrecondition for requests this node
    cannot serve (TensorRT-LLM without its package, tp or pp above 1, compression).
    """
    deployment_id = request.deployment_id
    require(bool(deployment_id), "deployment_id is empty")
    require(
        _DEPLOYMENT_ID.fullmatch(deployment_id) is not None,
        f"deployment_id {deployment_id!r} must be letters, digits, '.', '_' or '-'",
    )
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
    checkpoint_dir = resolve_checkpoint(models_root, request.checkpoint_path)
    workers = tuple(WorkerPlan(w.rank, devices[w.device_id]) for w in request.workers)
    config = _checkpoint_config(checkpoint_dir)
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
    )


def _checkpoint_config(checkpoint_dir: Path) -> dict:
    """The checkpoint's config.json, or {} when unreadable (the worker then reports why)."""
    try:
        return read_config(checkpoint_dir)
    except InvalidCheckpoint:
        return {}
