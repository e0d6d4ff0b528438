"""From a model's stored profile measurements to what ``services.estimation`` needs.

A profile holds raw :class:`ProfileMeasurement` records of two kinds:

* imported rows (MaverIQ's A6000 data): end-to-end latencies at several output lengths,
  memory summed over the GPUs split evenly over the ranks;
* rows iserve's profiler records on its own devices: TTFT and TPOT from the token
  stream's timestamps, peak memory per rank.

Both become :class:`Sample`\\ s, which ``extrapolation`` turns into the full-model
reference figures that ``services.estimation`` scores configurations with;
:func:`estimation_shape` and :func:`estimation_variants` give the model's shape and
variants in the estimation maths' terms.

A sample's *prompt label* is ``(input tokens, batch size)``; ``input_tokens = 0`` means
the source did not record the prompt length (MaverIQ's short-prompt files).

Pure: no gRPC, Redis or I/O; protobuf messages are only read.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.contention import NOTE_START, share_of
from services.estimation.extrapolate import LatencySample
from services.estimation.latency import decode_steps
from services.estimation.memory import GIB
from services.estimation.space import ModelShape, Variant

# The start of a PROFILED model's reason when its profile lacks jobs that profiling again
# would measure (an agent or a worker gone mid-job): the model service writes it, its
# registration takes such a model again, and its estimates repeat it.
INCOMPLETE = "incomplete: "


def profiled_reason(incomplete: str, contended: str) -> str:
    """A PROFILED model's reason: what its profile lacks (``INCOMPLETE``…), then the
    contention note of its runs; either may be empty."""
    return "; ".join(part for part in (incomplete, contended) if part)


def incomplete_part(reason: str) -> str | None:
    """What a PROFILED model's ``reason`` (:func:`profiled_reason`) says its profile
    lacks, without the contention note that may follow; None for a complete profile."""
    if not reason.startswith(INCOMPLETE):
        return None
    return re.sub(f"; {NOTE_START}.*$", "", reason)


__all__ = [
    "Sample",
    "estimation_shape",
    "estimation_variants",
    "sample_from_measurement",
    "variant_key",
]

Layout = tuple[int, int]
PromptLabel = tuple[int, int]  # (input tokens, batch size); 0 input tokens: not recorded

WEIGHT_QUANT_NAMES = {
    common.WEIGHT_QUANT_UNSPECIFIED: "fp16",
    common.WEIGHT_QUANT_NONE: "fp16",
    common.WEIGHT_QUANT_INT8: "int8",
    common.WEIGHT_QUANT_INT4: "int4",
    common.WEIGHT_QUANT_GPTQ_INT4: "int4_gptq",
    # Pre-quantized int4 either way: same footprint and kernels as GPTQ.
    common.WEIGHT_QUANT_AWQ_INT4: "int4_gptq",
}
KV_QUANT_NAMES = {
    common.KV_QUANT_UNSPECIFIED: "fp16",
    common.KV_QUANT_NONE: "fp16",
    common.KV_QUANT_INT8: "int8",
}
# What the profiler calls the base checkpoint in ProfileMeasurement.variant_name.
BASE_VARIANT_NAME = "base"
PRUNING_NAMES = {
    common.PRUNING_UNSPECIFIED: None,
    common.PRUNING_NONE: None,
    common.PRUNING_SEMI_STRUCTURED_2_4: "2:4",
    common.PRUNING_STRUCTURED: "structured",
}


@dataclass(frozen=True)
class Sample:
    """One profiling run in the estimation maths' units (seconds, GiB).

    A figure the run did not measure is 0: imported end-to-end rows have no TTFT/TPOT,
    the profiler's rows may have no end-to-end latency. ``memory_gib`` is summed over
    the run's ranks.
    """

    variant: str
    layers: int
    tp: int
    pp: int
    stage_layers: tuple[int, ...]
    input_tokens: int
    batch: int
    output_tokens: int
    latency_s: float
    ttft_s: float
    tpot_s: float
    memory_gib: float
    full_model: bool
    ttft_layer_s: float = 0.0
    tpot_layer_s: float = 0.0
    # One decoder layer's weights as the engine holds them, all ranks (0: unknown).
    layer_weight_gib: float = 0.0
    # One token's K and V in one decoder layer, all ranks, GiB (0: unknown).
    layer_kv_gib_per_token: float = 0.0
    # The share of its devices' cores other processes used meanwhile (None: not
    # measured; services.contention says when that slowed it).
    other_cpu_share: float | None = None

    @property
    def layout(self) -> Layout:
        return (self.tp, self.pp)

    @property
    def prompt(self) -> PromptLabel:
        return (self.input_tokens, self.batch)

    @property
    def balanced_stages(self) -> bool:
        """Layers split over the pipeline stages as evenly as they divide (or unknown)."""
        return not self.stage_layers or max(self.stage_layers) - min(self.stage_layers) <= 1

    @property
    def direct_phases(self) -> bool:
        """TTFT and TPOT were measured from token timestamps."""
        return self.ttft_s > 0 and self.tpot_s > 0

    def latency_samples(self) -> list[LatencySample]:
        """What this run tells the layer fit: TTFT and TPOT when measured directly (with
        the layer clock's per-layer times when the run has them), else the end-to-end
        latency (nothing when neither is usable)."""
        sample = functools.partial(LatencySample, self.layers, prompt=self.prompt, batch=self.batch)
        if self.direct_phases:
            samples = [sample(self.ttft_s, phase="ttft"), sample(self.tpot_s, phase="tpot")]
            if self.ttft_layer_s > 0 and self.tpot_layer_s > 0:
                samples += [
                    sample(self.ttft_layer_s, phase="ttft_layer"),
                    sample(self.tpot_layer_s, phase="tpot_layer"),
                ]
            return samples
        if self.latency_s > 0 and self.output_tokens >= 1:
            return [sample(self.latency_s, self.output_tokens)]
        return []

    def end_to_end_s(self) -> float:
        """End-to-end latency, measured or composed from TTFT and TPOT (0 when neither)."""
        if self.latency_s > 0:
            return self.latency_s
        if not self.direct_phases:
            return 0.0
        return self.ttft_s + float(decode_steps(self.output_tokens)) * self.tpot_s


def variant_key(m: model_pb.ProfileMeasurement) -> str:
    """The deployable name of a measurement's variant: ``config.variant_name`` ("" is the
    base checkpoint, as in ``DeploymentConfig``), else ``variant_name`` (which the
    profiler sets to ``base`` for the base checkpoint)."""
    if m.config.variant_name:
        return m.config.variant_name
    return "" if m.variant_name in ("", BASE_VARIANT_NAME) else m.variant_name


def sample_from_measurement(m: model_pb.ProfileMeasurement) -> Sample:
    """The :class:`Sample` of one stored measurement (keyed by :func:`variant_key`)."""
    config = m.config
    tp = max(1, config.tensor_parallel)
    pp = max(1, config.pipeline_parallel)
    return Sample(
        variant=variant_key(m),
        layers=int(m.num_layers),
        tp=tp,
        pp=pp,
        stage_layers=tuple(int(n) for n in m.stage_layers),
        input_tokens=int(m.input_tokens),
        batch=max(1, config.batch_size),
        output_tokens=int(m.output_tokens),
        latency_s=m.latency_ms / 1e3,
        ttft_s=m.ttft_ms / 1e3,
        tpot_s=m.tpot_ms / 1e3,
        memory_gib=sum(m.peak_memory_bytes_per_rank) / GIB,
        full_model=m.full_model,
        ttft_layer_s=m.ttft_layer_ms / 1e3,
        tpot_layer_s=m.tpot_layer_ms / 1e3,
        layer_weight_gib=m.layer_weight_bytes / GIB,
        layer_kv_gib_per_token=m.layer_kv_bytes_per_token / GIB,
        other_cpu_share=share_of(m),
    )


def estimation_shape(model: model_pb.Model) -> ModelShape:
    """The estimator's view of a model record's shape; ValueError when it has none."""
    s = model.shape
    if not (s.num_layers and s.num_attention_heads and s.num_kv_heads and s.head_dim):
        raise ValueError(f"model {model.model_id!r} has no shape (layers, heads, head size)")
    return ModelShape(
        model.model_id,
        s.num_layers,
        s.num_attention_heads,
        s.num_kv_heads,
        s.head_dim,
        mlp_width=s.intermediate_size,
        max_positions=s.max_position_embeddings,
        layer_weights=_layer_weights(s),
        hidden_size=s.hidden_size,
    )


def _layer_weights(shape: model_pb.ModelShape) -> int:
    """Weights of one decoder layer: the record's parameters less the token embedding and
    an untied LM head, over the layers (the final norm's few weights count in); 0 when
    the record does not give them."""
    if not (shape.parameter_count and shape.vocab_size and shape.hidden_size):
        return 0
    heads = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return max(0, (shape.parameter_count - heads) // shape.num_layers)


def _accuracy(model: model_pb.Model, variant_name: str, uncompressed: bool) -> float | None:
    for variant in model.variants:
        if variant.name == variant_name and variant.HasField("accuracy_score"):
            return variant.accuracy_score
    if uncompressed and model.HasField("accuracy_score"):
        return model.accuracy_score
    return None


def estimation_variants(
    model: model_pb.Model, measurements: Iterable[model_pb.ProfileMeasurement]
) -> dict[str, Variant]:
    """Every variant the measurements profile, keyed (and named) by :func:`variant_key`,
    in the order of the model record's variants, then of first appearance.

    The quantization and pruning come from the measured configuration; the accuracy
    from the model record (the uncompressed variant falls back to the model's score).
    An empty variant name is the base checkpoint.
    """
    order = {v.name: i for i, v in enumerate(model.variants)}
    found: dict[str, Variant] = {}
    for m in measurements:
        key = variant_key(m)
        if key in found:
            continue
        c = m.config
        weight = WEIGHT_QUANT_NAMES.get(c.weight_quant, "fp16")
        kv = KV_QUANT_NAMES.get(c.kv_quant, "fp16")
        pruning = PRUNING_NAMES.get(c.pruning)
        uncompressed = weight == "fp16" and kv == "fp16" and pruning is None
        found[key] = Variant(
            name=key,
            weight_quant=weight,
            kv_quant=kv,
            pruning=pruning,
            accuracy_pct=_accuracy(model, key, uncompressed),
        )
    first_seen = {name: i for i, name in enumerate(found)}
    ranked = sorted(found, key=lambda name: (order.get(name, len(order)), first_seen[name]))
    return {name: found[name] for name in ranked}
