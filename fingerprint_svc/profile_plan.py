"""What profiling a model runs and where, decided without I/O.

For every compression variant of the model (the base checkpoint as ``base``, then the
registered variants) and every reference configuration (tp, pp) in (1,1), (1,2), (2,1)
that the cluster and the model's heads allow, profiling runs fingerprints of pp and
pp + 1 layers (MaverIQ's choice: 1, 2 and 3 layers over the three references; capped at
the model's own layer count, where the fingerprint is the model itself) at every batch
size (1 and 2). One :class:`ProfileJob` is one such (variant, reference, layers, batch)
point; the agent runs it at every output length.

A reference is skipped for the whole model, with the reason recorded, when it needs more
devices than any one node has (a job's ranks run on one agent), more pipeline stages
than the model has layers, or a tensor-parallel split the engine cannot make: tp must
divide the attention heads and the MLP width, and either divide the KV heads or be a
multiple of them (the engine then replicates KV heads, so multi-query models do run at
tp = 2; see ``monitor_agent.engine.tensor_parallel``).

Its settings (prompt and output lengths, batch sizes, runs) are
``services.settings.ProfilingSettings``, read from the ModelService's environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.engine_rules import (
    default_dtype,
    deployed_compression_problem,
    even_stage_layers,
    parallel_problem,
)
from services.reservation import DTYPE_BYTES
from services.settings import ProfilingSettings
from services.state.capacity import free_bytes

MIB = 1 << 20
BASE_VARIANT = "base"
# (tp, pp) in the order profiled: (1,1) first, since the model fails without it.
REFERENCES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1))


@dataclass(frozen=True)
class VariantTarget:
    """One compression variant to profile and the checkpoint its fingerprints come from."""

    name: str
    # Relative to the models root: the variant's own checkpoint, else the model's.
    checkpoint_path: str
    weight_quant: int = common.WEIGHT_QUANT_NONE
    kv_quant: int = common.KV_QUANT_NONE
    pruning: int = common.PRUNING_NONE

    @property
    def is_base(self) -> bool:
        return self.name == BASE_VARIANT


def variant_targets(model: model_pb.Model) -> list[VariantTarget]:
    """The base model, then every registered variant, in registration order."""
    targets = [VariantTarget(BASE_VARIANT, model.checkpoint_path)]
    for v in model.variants:
        targets.append(
            VariantTarget(
                v.name,
                v.checkpoint_path or model.checkpoint_path,
                v.weight_quant,
                v.kv_quant,
                v.pruning,
            )
        )
    return targets


@dataclass(frozen=True)
class ProfileJob:
    """One RunProfilingJob: a variant's ``num_layers``-layer fingerprint at (tp, pp)."""

    variant: VariantTarget
    tensor_parallel: int
    pipeline_parallel: int
    num_layers: int
    batch_size: int

    @property
    def reference(self) -> tuple[int, int]:
        return self.tensor_parallel, self.pipeline_parallel

    @property
    def ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return even_stage_layers(self.num_layers, self.pipeline_parallel)

    def config(self) -> common.DeploymentConfig:
        return common.DeploymentConfig(
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            variant_name="" if self.variant.is_base else self.variant.name,
            weight_quant=self.variant.weight_quant,
            kv_quant=self.variant.kv_quant,
            pruning=self.variant.pruning,
            batch_size=self.batch_size,
        )

    def describe(self) -> str:
        layers = f"{self.num_layers} layer{'s' if self.num_layers != 1 else ''}"
        return (
            f"{self.variant.name} fingerprint({layers}) tp={self.tensor_parallel} "
            f"pp={self.pipeline_parallel} batch={self.batch_size}"
        )

    def worker_specs(self, device_ids: Sequence[str]) -> list[agent_pb.WorkerSpec]:
        """One WorkerSpec per rank (rank = stage·tp + tensor rank) on ``device_ids``."""
        if len(device_ids) != self.ranks:
            raise ValueError(f"{self.ranks} device(s) needed, got {len(device_ids)}")
        specs, first = [], 0
        for stage, count in enumerate(self.stage_layers):
            for tensor_rank in range(self.tensor_parallel):
                rank = stage * self.tensor_parallel + tensor_rank
                specs.append(
                    agent_pb.WorkerSpec(
                        rank=rank,
                        device_id=device_ids[rank],
                        stage=stage,
                        tensor_rank=tensor_rank,
                        first_layer=first,
                        layer_count=count,
                    )
                )
            first += count
        return specs


def reference_label(reference: tuple[int, int]) -> str:
    return f"tp={reference[0]} pp={reference[1]}"


def fingerprint_layers(pipeline_parallel: int, model_layers: int) -> tuple[int, ...]:
    """Layer counts of the fingerprints profiled at pipeline degree ``pipeline_parallel``:
    pp and pp + 1, capped at the model's layers (empty when pp exceeds them)."""
    return tuple(
        sorted({min(n, model_layers) for n in (pipeline_parallel, pipeline_parallel + 1)})
        if pipeline_parallel <= model_layers
        else ()
    )


def reference_skip_reason(
    shape: model_pb.ModelShape, reference: tuple[int, int], node_devices: int
) -> str | None:
    """Why no variant can be profiled at ``reference``, or None."""
    tp, pp = reference
    problem = parallel_problem(
        tp,
        pp,
        heads=shape.num_attention_heads,
        kv_heads=shape.num_kv_heads or shape.num_attention_heads,
        mlp_width=shape.intermediate_size,
        num_layers=shape.num_layers,
    )
    if problem:
        return problem
    if tp * pp > node_devices:
        return (
            f"needs {tp * pp} devices on one node; the largest node has {node_devices}"
            if node_devices
            else "no live node has devices"
        )
    return None


def plan_jobs(
    model: model_pb.Model, settings: ProfilingSettings, node_devices: int
) -> tuple[list[ProfileJob], list[str]]:
    """Every job of ``model`` in run order, and the references skipped with their reason
    (``node_devices``: devices of the largest live node)."""
    skipped, allowed = [], []
    for reference in REFERENCES:
        reason = reference_skip_reason(model.shape, reference, node_devices)
        if reason:
            skipped.append(f"{reference_label(reference)} (every variant): {reason}")
        else:
            allowed.append(reference)
    jobs = []
    for variant in variant_targets(model):
        for tp, pp in allowed:
            reason = deployed_compression_problem(
                model.shape, tp, weight_quant=variant.weight_quant, pruning=variant.pruning
            )
            if reason:
                # Its workers would exit at load: not launched, said why.
                skipped.append(f"variant {variant.name}: {reference_label((tp, pp))}: {reason}")
                continue
            jobs += [
                ProfileJob(variant, tp, pp, layers, batch)
                for layers in fingerprint_layers(pp, model.shape.num_layers)
                for batch in settings.batch_sizes
            ]
    return jobs, skipped


@dataclass(frozen=True)
class DeviceChoice:
    node_id: str
    agent_address: str
    devices: tuple[common.DeviceState, ...]

    @property
    def device_ids(self) -> list[str]:
        return [d.ref.device_id for d in self.devices]


def live_node_devices(nodes: Sequence[common.NodeState]) -> int:
    """Devices of the largest live node."""
    return max((len(n.devices) for n in nodes if n.alive), default=0)


def choose_devices(
    nodes: Sequence[common.NodeState], need_bytes: Sequence[int]
) -> DeviceChoice | None:
    """Devices for one job, all on one live node: idle ones first (lowest load, then most
    free memory), each with room for the largest rank's need. Among the nodes that can
    hold the job, the one whose chosen devices are least loaded (then have most free
    memory) wins. None when no node can."""
    count, need = len(need_bytes), max(need_bytes)
    best, best_key = None, None
    for node in nodes:
        if not node.alive:
            continue
        fitting = sorted(
            (d for d in node.devices if d.free_bytes >= need),
            key=lambda d: (d.load, -d.free_bytes, d.ref.device_id),
        )
        if len(fitting) < count:
            continue
        chosen = tuple(fitting[:count])
        key = (sum(d.load for d in chosen), -sum(d.free_bytes for d in chosen), node.node_id)
        if best_key is None or key < best_key:
            best, best_key = DeviceChoice(node.node_id, node.agent_address, chosen), key
    return best


def room_once_settled(nodes: Sequence[common.NodeState], need_bytes: Sequence[int]) -> bool:
    """Whether :func:`choose_devices` would find room if measured use beyond the
    reservations were gone: what a worker that just exited (its node's monitor not yet
    refreshed) or another passing process holds. Waiting is worth it then; otherwise
    only other jobs' reservations or too small devices stand in the way."""
    settled = []
    for node in nodes:
        copy = common.NodeState()
        copy.CopyFrom(node)
        for device in copy.devices:
            device.free_bytes = free_bytes(device.total_bytes, 0, device.reserved_bytes)
        settled.append(copy)
    return choose_devices(settled, need_bytes) is not None


def no_room_reason(nodes: Sequence[common.NodeState], need_bytes: Sequence[int]) -> str:
    """Why :func:`choose_devices` found nothing, naming the largest free device."""
    count, need = len(need_bytes), max(need_bytes)
    live = [d for n in nodes if n.alive for d in n.devices]
    if not live:
        return "no live node agent has devices"
    biggest = max(live, key=lambda d: d.free_bytes)
    what = "no device has" if count == 1 else f"no node has {count} devices with"
    reason = (
        f"{what} {need / MIB:.0f} MiB free (largest free: {biggest.free_bytes / MIB:.0f} MiB "
        f"on {biggest.ref.node_id}/{biggest.ref.device_id})"
    )
    if all(d.kind == common.DEVICE_KIND_CPU_VIRTUAL and d.total_bytes < need for d in live):
        # No amount of waiting frees enough: the budget is the operator's to raise.
        reason += (
            "; virtual CPU devices are as large as `iserve up --device-memory GIB` "
            "(ISERVE_DEVICE_MEMORY_GIB) makes them"
        )
    return reason


def compute_bytes_for(nodes: Sequence[common.NodeState], checkpoint_dtype: int) -> int:
    """Bytes per element a profiling job's workers compute in: engine_rules.default_dtype's
    for the checkpoint's dtype (a Precision) on CPU devices when any live device is one
    (the safe bound: float32), else on CUDA devices."""
    cpu = any(d.kind != common.DEVICE_KIND_CUDA for n in nodes if n.alive for d in n.devices)
    return DTYPE_BYTES[default_dtype(checkpoint_dtype, cuda=not cpu)]
