"""The configuration map of a model on a hardware type, and when it must be rebuilt.

The map is what every estimate of a model on one hardware type starts from: the
model's full-model reference figures per variant and profiled prompt length
(extrapolated from its fingerprint runs, :func:`model_references.model_references`) and the
hardware calibration they are scored with. From it, every configuration of any
workload and device count is one vectorised pass (:meth:`ConfigMap.estimate`), so the
map is what the estimator keeps in Redis (``keys.config_map(model, hardware)``) rather
than figures for one workload.

``source_hash`` fingerprints what the map was built from: the model's shape and
variants, its profile rows of that hardware type, the calibration and this module's
schema. The stored map is reused while the hash of the current sources matches, and
rebuilt otherwise (a new import or profile, a new calibration, an edited variant).

The stored form is JSON (readable with redis-cli); NaN figures (a TP-ladder layout a
variant was not profiled at) are ``null``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from google.protobuf import json_format

from estimator_svc.calibration_message import from_proto
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.estimation import model_references, profiles
from services.estimation.model_references import ModelReferences, PromptReferences, Workload
from services.estimation.references import ReferenceProfile, VariantProfile
from services.estimation.score import Calibration, Estimates
from services.estimation.space import ModelShape, Variant
from services.token_limits import check_positions

__all__ = [
    "SCHEMA_VERSION",
    "ConfigMap",
    "build_config_map",
    "from_json",
    "source_hash",
    "to_json",
]

# Bump when the map's content or the way it is built changes: stored maps then rebuild.
SCHEMA_VERSION = 8  # 8: notes say when other processes slowed the profile


def source_hash(
    model: model_pb.Model,
    measurements: Sequence[model_pb.ProfileMeasurement],
    calibration: estimator_pb.Calibration,
) -> str:
    """SHA-256 (hex) of everything a configuration map is built from."""
    digest = hashlib.sha256(f"iserve config map v{SCHEMA_VERSION}\n".encode())
    digest.update(model.shape.SerializeToString(deterministic=True))
    for variant in model.variants:
        digest.update(variant.SerializeToString(deterministic=True))
    if model.HasField("accuracy_score"):
        digest.update(repr(model.accuracy_score).encode())
    digest.update(f"\n{len(measurements)} measurements\n".encode())
    for m in measurements:
        digest.update(m.SerializeToString(deterministic=True))
    digest.update(calibration.SerializeToString(deterministic=True))
    return digest.hexdigest()


@dataclass(frozen=True)
class ConfigMap:
    """A model's references on one hardware type and the calibration that scores them."""

    model_id: str
    hardware_type: str
    source_hash: str
    built_at_unix_ms: int
    references: ModelReferences
    calibration: estimator_pb.Calibration

    @functools.cached_property
    def constants(self) -> tuple[Calibration, ModelReferences]:
        """The calibration's constants for these references, and the references to use
        them with (:meth:`HardwareCalibration.for_references`); parsed once per map."""
        return from_proto(self.calibration).for_references(self.references)

    def estimate(
        self, workload: Workload, devices: int, device_memory_gib: float | None = None
    ) -> tuple[Estimates, Workload]:
        """Every configuration on ``devices`` devices for ``workload``, and the workload
        as estimated (``input_tokens`` resolved to the default prompt length when 0: the
        longest profiled that leaves room for the output).

        InvalidArgument when prompt plus output tokens exceed the model's context."""
        calibration, references = self.constants
        default = references.default_input_tokens(workload.output_tokens)
        resolved = replace(workload, input_tokens=workload.input_tokens or default)
        check_positions(
            resolved.input_tokens,
            resolved.output_tokens,
            references.shape.max_positions,
            "workload input_tokens + output_tokens"
            if workload.input_tokens
            else f"output_tokens leave no prompt room: a {resolved.input_tokens}-token prompt "
            "+ output_tokens",
        )
        estimates = model_references.estimate(
            references, calibration, resolved, devices, device_memory_gib
        )
        return estimates, resolved


def build_config_map(
    model: model_pb.Model,
    measurements: Sequence[model_pb.ProfileMeasurement],
    calibration: estimator_pb.Calibration,
    hardware_type: str,
    now_ms: int,
) -> ConfigMap:
    """Extrapolate ``model``'s rows of ``hardware_type`` into a configuration map.

    Raises ValueError when the rows cannot determine the references.
    """
    shape = profiles.estimation_shape(model)
    variants = profiles.estimation_variants(model, measurements)
    samples = [profiles.sample_from_measurement(m) for m in measurements]
    return ConfigMap(
        model_id=model.model_id,
        hardware_type=hardware_type,
        source_hash=source_hash(model, measurements, calibration),
        built_at_unix_ms=now_ms,
        references=model_references.model_references(shape, variants, samples),
        calibration=calibration,
    )


def _numbers(values: Sequence[float]) -> list[float | None]:
    return [None if not math.isfinite(v) else float(v) for v in values]


def _floats(values: Sequence[float | None]) -> tuple[float, ...]:
    return tuple(float("nan") if v is None else float(v) for v in values)


def _reference_json(profile: ReferenceProfile | None) -> dict | None:
    if profile is None:
        return None
    return {
        "ttft_s": _numbers(profile.ttft_s),
        "tpot_s": _numbers(profile.tpot_s),
        "memory_gib": _numbers(profile.memory_gib),
    }


def _reference(data: dict | None, layouts: tuple) -> ReferenceProfile | None:
    if data is None:
        return None
    return ReferenceProfile(
        layouts, _floats(data["ttft_s"]), _floats(data["tpot_s"]), _floats(data["memory_gib"])
    )


def to_json(config_map: ConfigMap) -> str:
    """The stored form of a map."""
    refs = config_map.references
    return json.dumps(
        {
            "schema": SCHEMA_VERSION,
            "model_id": config_map.model_id,
            "hardware_type": config_map.hardware_type,
            "source_hash": config_map.source_hash,
            "built_at_unix_ms": config_map.built_at_unix_ms,
            "shape": asdict(refs.shape),
            "layouts": [list(layout) for layout in refs.layouts],
            "variants": [
                {
                    "name": v.name,
                    "weight_quant": v.weight_quant,
                    "kv_quant": v.kv_quant,
                    "pruning": v.pruning,
                    "accuracy_pct": v.accuracy_pct,
                }
                for v in refs.variants
            ],
            "prompts": [
                {
                    "input_tokens": prompt.input_tokens,
                    "kv_tokens_profiled": prompt.kv_tokens_profiled,
                    "profiles": [
                        {
                            "batch1": _reference_json(p.batch1),
                            "batch2": _reference_json(p.batch2),
                            "end_to_end_split": p.end_to_end_split,
                            "kv_gib_per_token": p.kv_gib_per_token,
                        }
                        for p in prompt.profiles
                    ],
                }
                for prompt in refs.prompts
            ],
            "notes": list(refs.notes),
            "calibration": json_format.MessageToDict(
                config_map.calibration, preserving_proto_field_name=True
            ),
        },
        separators=(",", ":"),
    )


def from_json(text: str) -> ConfigMap:
    """A stored map; ValueError when it is malformed or of another schema version."""
    try:
        data = json.loads(text)
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"configuration map schema {data.get('schema')!r}")
        layouts = tuple(tuple(layout) for layout in data["layouts"])
        prompts = tuple(
            PromptReferences(
                input_tokens=prompt["input_tokens"],
                kv_tokens_profiled=prompt["kv_tokens_profiled"],
                profiles=tuple(
                    VariantProfile(
                        _reference(p["batch1"], layouts),
                        _reference(p["batch2"], layouts),
                        prompt["kv_tokens_profiled"],
                        bool(p["end_to_end_split"]),
                        float(p["kv_gib_per_token"]),
                    )
                    for p in prompt["profiles"]
                ),
            )
            for prompt in data["prompts"]
        )
        references = ModelReferences(
            shape=ModelShape(**data["shape"]),
            variants=tuple(Variant(**v) for v in data["variants"]),
            layouts=layouts,
            prompts=prompts,
            notes=tuple(data["notes"]),
        )
        calibration = json_format.ParseDict(data["calibration"], estimator_pb.Calibration())
        return ConfigMap(
            model_id=data["model_id"],
            hardware_type=data["hardware_type"],
            source_hash=data["source_hash"],
            built_at_unix_ms=data["built_at_unix_ms"],
            references=references,
            calibration=calibration,
        )
    except (KeyError, TypeError, json.JSONDecodeError, json_format.ParseError) as exc:
        raise ValueError(f"malformed configuration map: {exc}") from None
