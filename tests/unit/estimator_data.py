"""Profiles for the estimator's unit tests: the A6000 data when present, and a tiny
synthetic model profiled the way iserve's profiler records runs (TTFT and TPOT from
token timestamps, peak memory per rank)."""

from __future__ import annotations

import os
from pathlib import Path

from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb

# Per-layer and other seconds (TTFT, TPOT) of the tiny model's fp16 variant, per layout.
TRUTH = {
    (1, 1): (0.010, 0.004, 0.002, 0.001),
    (2, 1): (0.006, 0.005, 0.0012, 0.0012),
    (1, 2): (0.010, 0.006, 0.002, 0.0015),
}
# Variants of the tiny model: (name, weight quantization, speed factor, MiB per layer, accuracy).
TINY_VARIANTS = (
    ("fp16", common.WEIGHT_QUANT_NONE, 1.0, 100, 100.0),
    ("int8", common.WEIGHT_QUANT_INT8, 0.8, 60, 99.5),
    ("int4", common.WEIGHT_QUANT_INT4, 0.6, 35, 90.0),
)
TINY_LAYERS = 8


def shared_data() -> Path:
    """The MaverIQ A6000 directory: ``$ISERVE_SHARED_DATA`` or ``<repo>/../shared/data``."""
    env = os.environ.get("ISERVE_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
    return base / "maveriq-a6000"


def profiler_rows(
    variant: str,
    weight_quant: int,
    *,
    speed: float = 1.0,
    layer_mib: int = 100,
    input_tokens: int = 32,
    hardware_type: str = "cpu-x86_64",
    layer_counts: tuple[int, ...] | None = None,
    model_layers: int = TINY_LAYERS,
) -> list[model_pb.ProfileMeasurement]:
    """Runs of ``variant`` ("" for the base checkpoint, which the profiler names
    ``base``) at the three references, with ``pp`` and ``pp + 1`` layers capped at
    ``model_layers`` (or ``layer_counts``); runs of ``model_layers`` layers are
    full-model runs."""
    rows = []
    for (tp, pp), (f_layer, f_other, p_layer, p_other) in TRUTH.items():
        for layers in layer_counts or sorted({min(pp, model_layers), min(pp + 1, model_layers)}):
            ranks = tp * pp
            rows.append(
                model_pb.ProfileMeasurement(
                    variant_name=variant or "base",
                    num_layers=layers,
                    full_model=layers == model_layers,
                    config=common.DeploymentConfig(
                        tensor_parallel=tp,
                        pipeline_parallel=pp,
                        variant_name=variant,
                        weight_quant=weight_quant,
                        kv_quant=common.KV_QUANT_NONE,
                        pruning=common.PRUNING_NONE,
                        batch_size=1,
                    ),
                    input_tokens=input_tokens,
                    output_tokens=16,
                    ttft_ms=1e3 * (layers * f_layer * speed + f_other),
                    tpot_ms=1e3 * (layers * p_layer * speed + p_other),
                    # The layers' memory split over the ranks, 500 MiB per rank besides.
                    peak_memory_bytes_per_rank=[((layers * layer_mib << 20) // ranks) + (500 << 20)]
                    * ranks,
                    repetitions=3,
                    hardware_type=hardware_type,
                )
            )
    return rows


def tiny_model(model_id: str = "tiny") -> model_pb.Model:
    """A profiled model record with the tiny shape and its three variants."""
    model = model_pb.Model(model_id=model_id, state=model_pb.MODEL_STATE_PROFILED)
    model.shape.num_layers = TINY_LAYERS
    model.shape.num_attention_heads = 8
    model.shape.num_kv_heads = 4
    model.shape.head_dim = 16
    for name, weight, _, _, accuracy in TINY_VARIANTS:
        model.variants.add(
            name=name,
            weight_quant=weight,
            kv_quant=common.KV_QUANT_NONE,
            pruning=common.PRUNING_NONE,
            accuracy_score=accuracy,
        )
    return model


def tiny_rows(hardware_type: str = "cpu-x86_64", full_model: bool = False) -> list:
    """Fingerprint runs of every tiny variant (and full-model runs with ``full_model``)."""
    rows = []
    for name, weight, speed, layer_mib, _ in TINY_VARIANTS:
        kwargs = {"speed": speed, "layer_mib": layer_mib, "hardware_type": hardware_type}
        rows += profiler_rows(name, weight, **kwargs)
        if full_model:
            rows += profiler_rows(name, weight, layer_counts=(TINY_LAYERS,), **kwargs)
    return rows
