"""Registration decisions, free of gRPC and Redis: whether a checkpoint is a model iserve
can serve, and the record that describes it (which paths are allowed is
``services.engine_rules.resolve_checkpoint``)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from fingerprint_svc.profile_plan import BASE_VARIANT
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.engine_rules import compression_problem, resolve_checkpoint, served_prune_fractions
from services.errors import AlreadyExists, InvalidArgument
from services.estimation.profiles import incomplete_part
from services.ids import check_model_id, check_variant_name
from services.models.arch import ArchSpec, unlike_model
from services.models.checkpoint import ValidatedCheckpoint, validate_checkpoint

FAMILIES = {
    "llama": common.MODEL_FAMILY_LLAMA,
    "mistral": common.MODEL_FAMILY_MISTRAL,
    "qwen2": common.MODEL_FAMILY_QWEN2,
    "falcon": common.MODEL_FAMILY_FALCON,
    "gptj": common.MODEL_FAMILY_GPTJ,
}
PRECISIONS = {
    "float32": common.PRECISION_FLOAT32,
    "float16": common.PRECISION_FLOAT16,
    "bfloat16": common.PRECISION_BFLOAT16,
}


def inspect_checkpoint(path: Path, label: str) -> ValidatedCheckpoint:
    """Validate a checkpoint, turning every problem into InvalidArgument naming ``label``."""
    try:
        return validate_checkpoint(path)
    except (ValueError, OSError) as exc:
        raise InvalidArgument(f"{label}: {exc}") from exc
    except RecursionError as exc:  # a file nested deeper than a reader of it handles
        raise InvalidArgument(f"{label}: a file of it is nested too deeply to read") from exc


# Every variant is profiled and scored: a few dozen at most make sense (the A6000 data
# has 12); without a bound, 100,000 were registered and every catalogue read carried them.
MAX_VARIANTS = 64
# A variant's settings that compress nothing.
_NO_COMPRESSION = (common.WEIGHT_QUANT_NONE, common.KV_QUANT_NONE, common.PRUNING_NONE)


def check_variants(variants: list[common.CompressionVariant]) -> None:
    if len(variants) > MAX_VARIANTS:
        raise InvalidArgument(f"variants: at most {MAX_VARIANTS}, got {len(variants)}")
    seen: set[str] = set()
    for variant in variants:
        if not variant.name:
            raise InvalidArgument("every compression variant needs a name")
        check_variant_name(variant.name)
        if variant.name == BASE_VARIANT:
            raise InvalidArgument(
                f"variant name {BASE_VARIANT!r} is reserved for the uncompressed model"
            )
        if variant.name in seen:
            raise InvalidArgument(f"compression variant {variant.name!r} is listed twice")
        seen.add(variant.name)
        unspecified = [
            field
            for field, value in (
                ("weight_quant", variant.weight_quant),
                ("kv_quant", variant.kv_quant),
                ("pruning", variant.pruning),
            )
            if value == 0
        ]
        if unspecified:
            raise InvalidArgument(
                f"variant {variant.name!r}: {', '.join(unspecified)} must be set (not UNSPECIFIED)"
            )
        for field, enum in (
            ("weight_quant", common.WeightQuant),
            ("kv_quant", common.KvQuant),
            ("pruning", common.Pruning),
        ):
            if getattr(variant, field) not in enum.values():
                raise InvalidArgument(
                    f"variant {variant.name!r}: {field} {getattr(variant, field)} is not a "
                    "known value"
                )
        settings = (variant.weight_quant, variant.kv_quant, variant.pruning)
        if settings == _NO_COMPRESSION and not (
            variant.checkpoint_path or variant.structured_prune_fraction
        ):
            # The CLI refused it, and the API took it: the base model profiled and
            # deployed again under another name (a tester). A checkpoint of its own (a
            # model pruned beforehand) is another model.
            raise InvalidArgument(
                f"variant {variant.name!r} names no compression (weight_quant, kv_quant and "
                f"pruning all NONE, no checkpoint of its own): it would be the model "
                f"itself, {BASE_VARIANT!r}"
            )
        if variant.HasField("accuracy_score"):
            check_accuracy_score(variant.accuracy_score, f"variant {variant.name!r}")
        if not 0.0 <= variant.structured_prune_fraction < 1.0:
            raise InvalidArgument(
                f"variant {variant.name!r}: structured_prune_fraction must be in [0, 1)"
            )
        (served,) = served_prune_fractions(True)
        if variant.structured_prune_fraction not in (0.0, served):
            # Accepted, it was profiled and served at the default share all the same,
            # its accuracy score then standing for a model nobody ran.
            raise InvalidArgument(
                f"variant {variant.name!r}: structured_prune_fraction "
                f"{variant.structured_prune_fraction:g} cannot be served: a structured "
                f"variant is profiled and deployed with {served:g} of its "
                "heads and MLP channels dropped (a DeploymentConfig carries no fraction); "
                f"give {served:g} or leave it unset"
            )


def check_accuracy_score(score: float, what: str) -> None:
    """An accuracy score (MMLU-style, higher is better) is a finite number, 0 or more:
    what an intent's min_accuracy is compared with (services.intents)."""
    if not (math.isfinite(score) and score >= 0):
        raise InvalidArgument(
            f"{what}: accuracy_score must be a finite number, 0 or more (e.g. an MMLU score "
            f"or % of the uncompressed model's), got {score}"
        )


def variant_problem(
    variant: common.CompressionVariant, spec: ArchSpec, base: ArchSpec | None = None
) -> str | None:
    """Why ``variant`` cannot apply to a model shaped ``spec`` (its own checkpoint's shape
    when it has one, ``base`` then being the model's), or None."""
    if base is not None:
        unlike = unlike_model(spec, lambda name: getattr(base, name))
        if unlike is not None:
            return unlike
    if variant.structured_prune_fraction and variant.pruning != common.PRUNING_STRUCTURED:
        return "structured_prune_fraction is set but pruning is not PRUNING_STRUCTURED"
    # What deployments drop (check_variants refuses a variant's own other fraction).
    fractions = served_prune_fractions(variant.pruning == common.PRUNING_STRUCTURED)
    return compression_problem(
        1,
        hidden=spec.hidden_size,
        heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        mlp_width=spec.intermediate_size,
        int4=variant.weight_quant == common.WEIGHT_QUANT_INT4,
        sparse_2_4=variant.pruning == common.PRUNING_SEMI_STRUCTURED_2_4,
        prune_fractions=fractions,
    )


def model_shape(spec: ArchSpec, weight_bytes: int) -> model_pb.ModelShape:
    """The API's description of a model's shape; ``weight_bytes`` as stored."""
    return model_pb.ModelShape(
        family=FAMILIES.get(spec.family, common.MODEL_FAMILY_UNSPECIFIED),
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        dtype=PRECISIONS.get(spec.torch_dtype, common.PRECISION_UNSPECIFIED),
        parameter_count=spec.parameter_count(),
        weight_bytes=weight_bytes,
    )


def build_model(request: model_pb.RegisterModelRequest, models_root: Path) -> model_pb.Model:
    """Validate everything a RegisterModel request names and return the record to store."""
    check_model_id(request.model_id)
    if request.HasField("accuracy_score"):
        check_accuracy_score(request.accuracy_score, f"model {request.model_id!r}")
    path = resolve_checkpoint(models_root, request.checkpoint_path)
    checkpoint = inspect_checkpoint(path, f"checkpoint {request.checkpoint_path!r}")
    if not checkpoint.has_tokenizer:
        raise InvalidArgument(f"checkpoint {request.checkpoint_path!r} has no tokenizer.json")
    variants = list(request.variants)
    check_variants(variants)
    for variant in variants:
        spec, base = checkpoint.spec, None
        if variant.checkpoint_path:
            vpath = resolve_checkpoint(models_root, variant.checkpoint_path)
            vcheck = inspect_checkpoint(vpath, f"variant {variant.name!r}")
            if vcheck.spec.num_layers != checkpoint.spec.num_layers:
                raise InvalidArgument(
                    f"variant {variant.name!r} has {vcheck.spec.num_layers} layers, "
                    f"the model has {checkpoint.spec.num_layers}"
                )
            spec, base = vcheck.spec, checkpoint.spec
            variant.checkpoint_path = str(vpath.relative_to(models_root.resolve()))
        problem = variant_problem(variant, spec, base)
        if problem:
            raise InvalidArgument(f"variant {variant.name!r} cannot apply to this model: {problem}")
    model = model_pb.Model(
        model_id=request.model_id,
        checkpoint_path=str(path.relative_to(models_root.resolve())),
        shape=model_shape(checkpoint.spec, checkpoint.weight_bytes),
        variants=variants,
        state=model_pb.MODEL_STATE_REGISTERED,
        created_at_unix_ms=int(time.time() * 1000),
    )
    if request.HasField("accuracy_score"):
        model.accuracy_score = request.accuracy_score
    return model


def state_name(state: int) -> str:
    """A model state as messages and the CLI say it: ``REGISTERED``, not
    ``MODEL_STATE_REGISTERED``."""
    return model_pb.ModelState.Name(state).removeprefix("MODEL_STATE_")


def check_retry(
    existing: model_pb.Model, model: model_pb.Model, *, profiling: bool, skip_profiling: bool
) -> None:
    """Registering an id that is taken retries it only when the recorded model FAILED, was
    registered without profiling and is now to be profiled, or was profiled incompletely
    (its reason says "register the model again": it was refused, a probe), with the same
    checkpoint (and is not being profiled); anything else is AlreadyExists."""
    state = state_name(existing.state)
    unprofiled = existing.state == model_pb.MODEL_STATE_REGISTERED and not skip_profiling
    incomplete = (
        existing.state == model_pb.MODEL_STATE_PROFILED
        and incomplete_part(existing.state_reason) is not None
        and not skip_profiling
    )
    retried = existing.state == model_pb.MODEL_STATE_FAILED or unprofiled or incomplete
    if not retried or profiling:
        again = (
            ""
            if profiling
            else f"; to register it again, delete it first (`iserve model delete "
            f"{model.model_id}`, once no deployment serves it)"
        )
        raise AlreadyExists(f"model {model.model_id!r} is already registered ({state}){again}")
    if existing.checkpoint_path != model.checkpoint_path:
        raise AlreadyExists(
            f"model {model.model_id!r} is registered with checkpoint "
            f"{existing.checkpoint_path!r}; a {state} model is registered again only with "
            "the same checkpoint (delete it to register another)"
        )
