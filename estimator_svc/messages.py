"""EstimatorService messages to domain values and back; every check a request needs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from estimator_svc.ranking import RankedConfigs
from services.api import common_pb2 as common
from services.api import estimator_service_pb2 as estimator_pb
from services.errors import InvalidArgument
from services.estimation.memory import GIB
from services.estimation.model_references import Workload
from services.estimation.score import Estimates
from services.estimation.space import ConfigSpace
from services.token_limits import check_batch_size

__all__ = [
    "estimate_messages",
    "ranked_messages",
    "workload_from_proto",
]

_WEIGHT_QUANTS = {
    "fp16": common.WEIGHT_QUANT_NONE,
    "int8": common.WEIGHT_QUANT_INT8,
    "int4": common.WEIGHT_QUANT_INT4,
    "int4_gptq": common.WEIGHT_QUANT_GPTQ_INT4,
}
_KV_QUANTS = {"fp16": common.KV_QUANT_NONE, "int8": common.KV_QUANT_INT8}
_PRUNINGS = {
    None: common.PRUNING_NONE,
    "2:4": common.PRUNING_SEMI_STRUCTURED_2_4,
    "structured": common.PRUNING_STRUCTURED,
}


def workload_from_proto(workload: estimator_pb.Workload) -> Workload:
    """The workload of a request; output_tokens must be set, batch size 0 means 1 (at
    most a deployment's largest batch). Prompt and output against the model's context
    are checked once the model is known (``ConfigMap.estimate``)."""
    if workload.output_tokens < 1:
        raise InvalidArgument("workload.output_tokens must be at least 1")
    check_batch_size(workload.batch_size, "workload.batch_size")
    return Workload(
        output_tokens=workload.output_tokens,
        input_tokens=workload.input_tokens,
        batch_size=max(1, workload.batch_size),
    )


def estimate_messages(
    estimates: Estimates,
    workload: Workload,
    indices: Sequence[int] | np.ndarray | None = None,
    communication_unprofiled: np.ndarray | None = None,
) -> list[estimator_pb.ConfigEstimate]:
    """``ConfigEstimate`` messages of the configurations at ``indices`` (default: all).

    Bytes from GiB; costs in the API's units (GB x s, GB, device-hours);
    ``communication_unprofiled`` per configuration of the space (default: none).
    """
    e = estimates
    space = e.space
    chosen = np.arange(space.size) if indices is None else np.asarray(indices, dtype=int)
    gb = e.memory_total_gib * GIB / 1e9
    messages = []
    for i in chosen.tolist():
        message = estimator_pb.ConfigEstimate(
            config=config_of(space, i),
            memory_total_bytes=round(e.memory_total_gib[i] * GIB),
            memory_per_device_bytes=round(e.memory_per_device_gib[i] * GIB),
            kv_cache_bytes=round(float(e.kv_cache_gib[i]) * GIB),
            ttft_ms=e.ttft_s[i] * 1e3,
            tpot_ms=e.tpot_s[i] * 1e3,
            latency_ms=e.latency_s[i] * 1e3,
            cost_memory_latency=e.cost_memory_latency[i] * GIB / 1e9,  # GiB x s to GB x s
            cost_memory=gb[i],
            cost_device_hours=e.cost_device_hours[i],
            throughput_tokens_per_second_per_device=e.throughput_tokens_per_s_per_device[i],
            batch_measured=e.batch_measured,
            communication_unprofiled=(
                communication_unprofiled is not None and bool(communication_unprofiled[i])
            ),
            fits_device_memory=bool(e.fits[i]),
        )
        if np.isfinite(e.accuracy_pct[i]):
            message.accuracy_score = float(e.accuracy_pct[i])
        messages.append(message)
    return messages


def config_of(space: ConfigSpace, index: int) -> common.DeploymentConfig:
    """The deployment configuration of the space's configuration ``index``."""
    row = space.configs[index]
    variant = space.variants[int(row["variant"])]
    return common.DeploymentConfig(
        tensor_parallel=int(row["tp"]),
        pipeline_parallel=int(row["pp"]),
        variant_name=variant.name,
        weight_quant=_WEIGHT_QUANTS[variant.weight_quant],
        kv_quant=_KV_QUANTS[variant.kv_quant],
        pruning=_PRUNINGS.get(variant.pruning, common.PRUNING_UNSPECIFIED),
        batch_size=int(row["batch"]),
    )


def ranked_messages(
    estimates: Estimates,
    workload: Workload,
    ranked: RankedConfigs,
    communication_unprofiled: np.ndarray | None = None,
) -> list[estimator_pb.RankedConfig]:
    """``RankedConfig`` messages, rank 1 first."""
    shortfalls = ranked.shortfalls or ("",) * len(ranked.indices)
    return [
        estimator_pb.RankedConfig(
            rank=place, estimate=message, meets_intent=bool(meets), shortfall=shortfall
        )
        for place, (message, meets, shortfall) in enumerate(
            zip(
                estimate_messages(estimates, workload, ranked.indices, communication_unprofiled),
                ranked.meets_intent,
                shortfalls,
                strict=True,
            ),
            start=1,
        )
    ]
