"""Checking an explicit DeploymentConfig against the model and what the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.engine_rules import (
    check_dtype,
    check_weight_quant,
    default_dtype,
    deployed_compression_problem,
    parallel_problem,
)
from services.errors import InvalidArgument, shown
from services.token_limits import check_batch_size, sequence_length, token_limits


@dataclass(frozen=True)
class ExplicitPlan:
    config: common.DeploymentConfig
    max_input_tokens: int
    max_output_tokens: int

    @property
    def max_seq_len(self) -> int:
        return sequence_length(self.max_input_tokens, self.max_output_tokens)


def resolve_explicit(
    model: model_pb.Model,
    requested: common.DeploymentConfig,
    *,
    batch_size: int,
    max_input_tokens: int,
    max_output_tokens: int,
    cuda: bool = False,
) -> ExplicitPlan:
    """Normalise ``requested`` (0 and UNSPECIFIED mean defaults) and check it; raises
    InvalidArgument for what can never work and Unimplemented for what the engine
    cannot run yet (float16 is served on CUDA devices only: ``cuda``; a dtype left
    unset is engine_rules.default_dtype's)."""
    shape = model.shape
    config = common.DeploymentConfig()
    config.CopyFrom(requested)
    config.tensor_parallel = config.tensor_parallel or 1
    config.pipeline_parallel = config.pipeline_parallel or 1
    problem = parallel_problem(
        config.tensor_parallel,
        config.pipeline_parallel,
        heads=shape.num_attention_heads,
        kv_heads=shape.num_kv_heads or shape.num_attention_heads,
        mlp_width=shape.intermediate_size,
        num_layers=shape.num_layers,
    )
    if problem:
        raise InvalidArgument(f"{model.model_id}: {problem}")
    if config.variant_name:
        apply_variant(model, config)
    config.weight_quant = config.weight_quant or common.WEIGHT_QUANT_NONE
    config.kv_quant = config.kv_quant or common.KV_QUANT_NONE
    config.pruning = config.pruning or common.PRUNING_NONE
    if not config.dtype:
        config.dtype = default_dtype(shape.dtype, cuda=cuda)
    config.batch_size, max_in, max_out = _limits(
        model, batch_size or config.batch_size, max_input_tokens, max_output_tokens
    )
    check_compression(config)
    problem = deployed_compression_problem(
        shape, config.tensor_parallel, weight_quant=config.weight_quant, pruning=config.pruning
    )
    if problem:
        # Refused here, not by a worker that exits after reading the checkpoint.
        raise InvalidArgument(f"{model.model_id} at tp={config.tensor_parallel}: {problem}")
    check_dtype(config.dtype, cuda=cuda)
    return ExplicitPlan(config, max_in, max_out)


def resolve_limits(model: model_pb.Model, request, *, cuda: bool = False) -> ExplicitPlan:
    """The limits of a Deploy/PlanDeployment request: its explicit configuration
    resolved, or for an intent only the batch size (0 means 1) and token limits checked."""
    if request.HasField("config"):
        return resolve_explicit(
            model,
            request.config,
            batch_size=request.batch_size,
            max_input_tokens=request.max_input_tokens,
            max_output_tokens=request.max_output_tokens,
            cuda=cuda,
        )
    batch, max_in, max_out = _limits(
        model, request.batch_size, request.max_input_tokens, request.max_output_tokens
    )
    return ExplicitPlan(common.DeploymentConfig(batch_size=batch), max_in, max_out)


def _limits(
    model: model_pb.Model, batch_size: int, max_input_tokens: int, max_output_tokens: int
) -> tuple[int, int, int]:
    """(batch size, max input, max output) with defaults for 0, checked against the
    batch limit and the model's positions (when its shape knows them)."""
    batch = batch_size or 1
    check_batch_size(batch)
    max_in, max_out = token_limits(
        max_input_tokens, max_output_tokens, model.shape.max_position_embeddings
    )
    return batch, max_in, max_out


def check_compression(config: common.DeploymentConfig) -> None:
    """The engine quantizes (int8, int4 weights; int8 KV cache) and prunes (2:4,
    structured) at load time; InvalidArgument for unknown values, Unimplemented for
    pre-quantized GPTQ/AWQ checkpoints."""
    for field, enum in (
        ("weight_quant", common.WeightQuant),
        ("kv_quant", common.KvQuant),
        ("pruning", common.Pruning),
    ):
        value = getattr(config, field)
        if value not in enum.values():
            raise InvalidArgument(f"{field} {value} is not a known value")
    check_weight_quant(config.weight_quant)


def variant_of(model: model_pb.Model, name: str) -> common.CompressionVariant:
    """The model's variant called ``name``; InvalidArgument when it has none."""
    for variant in model.variants:
        if variant.name == name:
            return variant
    raise InvalidArgument(
        f"model {model.model_id} has no variant {shown(name)} "
        f"(variants: {', '.join(v.name for v in model.variants) or 'none'})"
    )


def apply_variant(model: model_pb.Model, config: common.DeploymentConfig) -> None:
    """Fill ``config``'s compression from its named variant. A field the config sets
    must agree with the variant's (InvalidArgument otherwise)."""
    variant = variant_of(model, config.variant_name)
    for field in ("weight_quant", "kv_quant", "pruning"):
        wanted, given = getattr(variant, field), getattr(config, field)
        if given and wanted and given != wanted:
            enum = common.DeploymentConfig.DESCRIPTOR.fields_by_name[field].enum_type
            raise InvalidArgument(
                f"config.{field} {enum.values_by_number[given].name} contradicts variant "
                f"{variant.name!r} ({enum.values_by_number[wanted].name})"
            )
        setattr(config, field, given or wanted)


def checkpoint_for(model: model_pb.Model, config: common.DeploymentConfig) -> str:
    """The checkpoint the workers load: the variant's own one when it has it."""
    if config.variant_name:
        own = variant_of(model, config.variant_name).checkpoint_path
        if own:
            return own
    return model.checkpoint_path
