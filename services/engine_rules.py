"""What the engine can run: the one list every service asks.

The estimator's configuration space, the deployer, the profiler's plan, the node agent
and the worker all take these rules from here, so the estimator never ranks a
configuration the deployer will refuse for an engine reason, and a refusal reads the same
wherever it happens. Torch-free (the worker reads it before torch starts its threads).

- Tensor parallelism: tp in TENSOR_PARALLEL_DEGREES, dividing the attention heads and
  the MLP width, and either dividing the KV heads or being a multiple of them (fewer KV
  heads than ranks are replicated: a multi-query model runs at tp = 2; see
  ``monitor_agent.engine.tensor_parallel``).
- Pipeline parallelism: 1 to MAX_PIPELINE_PARALLEL stages, at most one per layer.
- Derived compressions: int4 weights need every projection's input width on a tensor
  rank divisible by INT4_MIN_GROUP, 2:4 pruning by SPARSE_2_4_GROUP (each rank
  quantizes and prunes its own shard; ``compression_problem``).
- Dtypes: float32 and bfloat16 everywhere, float16 on CUDA devices only. Left unset, a
  deployment computes in the checkpoint's dtype on CUDA devices and in float32 on CPUs
  (``default_dtype``), as profiling jobs do, so estimates describe what is served.
- Pre-quantized (GPTQ/AWQ) checkpoints are not loaded; int8/int4 quantize at load time.
- Checkpoints are read only from under the models root, and a deployment or a profiling
  job only from one that is still the model registered from it (``check_still_the_model``;
  for a deployment also its weights' headers, ``check_weights_still_the_model``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.errors import (
    CheckpointChanged,
    CheckpointUnusable,
    InvalidArgument,
    Unimplemented,
    shown,
)
from services.models.arch import unlike_model
from services.models.checkpoint_files import (
    CHAT_TEMPLATE_DIR,
    read_safetensors_index,
    weight_files,
)
from services.models.compression import DEFAULT_PRUNE_FRACTION, kept_heads, kept_mlp_channels
from services.models.errors import InvalidCheckpoint
from services.models.families import parse_config

TENSOR_PARALLEL_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
MAX_PIPELINE_PARALLEL = 8
CPU_DTYPES = (common.PRECISION_FLOAT32, common.PRECISION_BFLOAT16)
CUDA_DTYPES = (*CPU_DTYPES, common.PRECISION_FLOAT16)
PRE_QUANTIZED = (common.WEIGHT_QUANT_GPTQ_INT4, common.WEIGHT_QUANT_AWQ_INT4)
# Input widths the engine's derived compressions need every projection's to be divisible
# by: int4 groups of at least 8 inputs (monitor_agent.engine.quantize.int4_group_size),
# 2:4 pruning groups of 4 inputs (monitor_agent.engine.prune).
INT4_MIN_GROUP = 8
SPARSE_2_4_GROUP = 4


def tensor_parallel_problem(tp: int, *, heads: int, kv_heads: int, mlp_width: int) -> str | None:
    """Why the engine cannot split a model ``tp`` ways, or None when it can.
    ``mlp_width`` 0 means unknown (a shape imported without it) and is not checked."""
    if tp not in TENSOR_PARALLEL_DEGREES:
        return f"tensor_parallel must be one of {TENSOR_PARALLEL_DEGREES}, got {tp}"
    if heads % tp:
        return f"tensor_parallel {tp} must divide the {heads} attention heads"
    if kv_heads % tp and tp % kv_heads:
        return f"tensor_parallel {tp} must divide the {kv_heads} KV heads or be a multiple of them"
    if mlp_width and mlp_width % tp:
        return f"tensor_parallel {tp} must divide the MLP width {mlp_width}"
    return None


def kv_heads_on_rank(kv_heads: int, tp: int) -> int:
    """KV heads one of ``tp`` tensor ranks holds: its share, or one whole head when tp
    does not divide them (the engine replicates it; ``tensor_parallel.head_slice``)."""
    return max(1, -(-kv_heads // tp))


def even_stage_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage, split evenly, the earlier stages taking the remainder:
    how a deployment, a profiling job and TensorRT-LLM split a model's layers when
    nothing else decides. ValueError unless 1 <= stages <= num_layers."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 if stage < extra else 0) for stage in range(stages))


def parallel_problem(
    tp: int, pp: int, *, heads: int, kv_heads: int, mlp_width: int, num_layers: int
) -> str | None:
    """Why the engine cannot run a model at (tp, pp), or None when it can."""
    problem = tensor_parallel_problem(tp, heads=heads, kv_heads=kv_heads, mlp_width=mlp_width)
    return problem or pipeline_parallel_problem(pp, num_layers)


def pipeline_parallel_problem(pp: int, num_layers: int | None) -> str | None:
    """Why the engine cannot split a model of ``num_layers`` layers (None: not known)
    into ``pp`` stages, or None when it can: every stage holds a layer at least, and
    there are at most MAX_PIPELINE_PARALLEL (a group of more waits for peers that
    cannot exist)."""
    limit = MAX_PIPELINE_PARALLEL if num_layers is None else min(MAX_PIPELINE_PARALLEL, num_layers)
    if 1 <= pp <= limit:
        return None
    layers = "" if num_layers is None else f" for {num_layers} layers"
    return f"pipeline_parallel must be 1..{limit}{layers}, got {pp}"


def projection_inputs(
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp_width: int,
    tp: int = 1,
    prune_fraction: float = 0.0,
) -> dict[str, int]:
    """The input widths of a decoder layer's projections on one of ``tp`` tensor ranks,
    after structured pruning of ``prune_fraction`` (each rank prunes its own shard): the
    hidden size (q/k/v, gate/up), the rank's attention output (o) and MLP width (down).
    ``mlp_width`` 0 (unknown) leaves the MLP out."""
    rank_heads, rank_mlp = heads // tp, mlp_width // tp
    if prune_fraction:
        rank_heads, _ = kept_heads(rank_heads, kv_heads_on_rank(kv_heads, tp), prune_fraction)
        rank_mlp = kept_mlp_channels(rank_mlp, prune_fraction)
    widths = {"hidden_size": hidden, "attention output (heads x head_dim)": rank_heads * head_dim}
    if mlp_width:
        widths["MLP width"] = rank_mlp
    return widths


def compression_problem(
    tp: int,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp_width: int,
    int4: bool,
    sparse_2_4: bool,
    prune_fractions: tuple[float, ...] = (0.0,),
) -> str | None:
    """Why the engine cannot quantize to int4 (``int4``) or 2:4-prune (``sparse_2_4``) a
    model split ``tp`` ways after structured pruning of each of ``prune_fractions``, or
    None: every projection's input width on a rank must be a positive multiple of the
    group. Call it for a ``tp`` that :func:`tensor_parallel_problem` allows."""
    if not (int4 or sparse_2_4 or any(prune_fractions)):
        return None
    needs = []
    if int4:
        needs.append(("int4 weight quantization", INT4_MIN_GROUP))
    if sparse_2_4:
        needs.append(("2:4 pruning", SPARSE_2_4_GROUP))
    shape = {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    for fraction in prune_fractions:
        pruned = f" after structured pruning of {fraction:g}" if fraction else ""
        where = f" on each of {tp} tensor ranks" if tp > 1 else ""
        widths = projection_inputs(**shape, mlp_width=mlp_width, tp=tp, prune_fraction=fraction)
        for name, width in widths.items():
            if width < 1:
                return f"the {name}{where}{pruned} would be {width}"
        for what, multiple in needs:
            for name, width in widths.items():
                if width % multiple:
                    return (
                        f"{what} needs every projection's input width divisible by "
                        f"{multiple}; the {name}{where}{pruned} is {width}"
                    )
    return None


def served_prune_fractions(structured: bool) -> tuple[float, ...]:
    """The structured-pruning shares a deployment (or profiling job) applies: the default
    one when ``structured`` (a DeploymentConfig does not carry a variant's own), else
    none."""
    return (DEFAULT_PRUNE_FRACTION,) if structured else (0.0,)


def deployed_compression_problem(
    shape: model_pb.ModelShape, tp: int, *, weight_quant: int, pruning: int
) -> str | None:
    """:func:`compression_problem` of a registered model's ``shape`` deployed (or
    profiled) at ``tp`` with ``weight_quant`` (a WeightQuant) and ``pruning`` (a
    Pruning): structured pruning at the share a deployment prunes
    (:func:`served_prune_fractions`)."""
    return compression_problem(
        tp,
        hidden=shape.hidden_size or shape.num_attention_heads * shape.head_dim,
        heads=shape.num_attention_heads,
        kv_heads=shape.num_kv_heads or shape.num_attention_heads,
        head_dim=shape.head_dim,
        mlp_width=shape.intermediate_size,
        int4=weight_quant == common.WEIGHT_QUANT_INT4,
        sparse_2_4=pruning == common.PRUNING_SEMI_STRUCTURED_2_4,
        prune_fractions=served_prune_fractions(pruning == common.PRUNING_STRUCTURED),
    )


def served_dtypes(*, cuda: bool) -> tuple[int, ...]:
    """The precisions the engine computes in on CUDA devices (``cuda``) or on CPUs."""
    return CUDA_DTYPES if cuda else CPU_DTYPES


def default_dtype(checkpoint: int, *, cuda: bool) -> int:
    """The precision a deployment or profiling job computes in when none is asked for: the
    checkpoint's own (``checkpoint``, a Precision; UNSPECIFIED when unknown) on CUDA
    devices, float32 on CPUs. On CPUs bfloat16 speed depends on the instruction set: a
    128-row product ran 2.7x faster than float32 with AVX-512 BF16 and 3.1x slower with
    AVX2 only (docs/engine.md, "float32 on CPUs"), so float32 is the default that is
    slow on no CPU and is what the profiles measured."""
    if cuda and checkpoint in CUDA_DTYPES:
        return checkpoint
    return common.PRECISION_FLOAT32


def check_dtype(precision: int, *, cuda: bool) -> None:
    """Unimplemented for a precision the engine does not compute in on CUDA devices
    (``cuda``) or on CPUs; InvalidArgument for a value the Precision enum lacks."""
    if precision not in common.Precision.values():
        raise InvalidArgument(f"dtype {precision} is not a known Precision value")
    served = served_dtypes(cuda=cuda)
    if precision not in served:
        where = "CUDA" if cuda else "CPU"

        def name(p: int) -> str:
            return common.Precision.Name(p).removeprefix("PRECISION_").lower()

        names = " and ".join(name(p) for p in served)
        raise Unimplemented(f"the PyTorch {where} engine serves {names}, not {name(precision)}")


def check_weight_quant(weight_quant: int) -> None:
    """Unimplemented for pre-quantized GPTQ/AWQ checkpoints, which the engine cannot load."""
    if weight_quant in PRE_QUANTIZED:
        raise Unimplemented(
            f"{common.WeightQuant.Name(weight_quant)}: the PyTorch engine does not load "
            "pre-quantized GPTQ/AWQ checkpoints yet; WEIGHT_QUANT_INT4 quantizes at load time"
        )


def resolve_checkpoint(models_root: Path, checkpoint_path: str) -> Path:
    """The checkpoint directory for ``checkpoint_path`` (relative to the models root or
    absolute inside it); InvalidArgument when it is empty or not a path, escapes the root
    (through ``..`` or a symlink), is not a directory, or holds a link to a file outside
    the root (a weight file linked to /etc/shadow is read as surely as the directory).
    The error is CheckpointUnusable: a start from that path fails the same way each time."""
    if not checkpoint_path:
        raise CheckpointUnusable("checkpoint_path is empty")
    if "\0" in checkpoint_path:
        raise CheckpointUnusable(f"checkpoint_path {shown(checkpoint_path)} contains a NUL byte")
    root = models_root.resolve()
    candidate = Path(checkpoint_path)
    try:
        resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if resolved.is_relative_to(root) and resolved.is_dir():
            _check_entries_inside(checkpoint_path, resolved, root)
    except (OSError, RuntimeError) as exc:
        # A name too long, a link loop (RuntimeError before Python 3.13), a directory it
        # may not list.
        reason = getattr(exc, "strerror", None) or exc
        raise CheckpointUnusable(
            f"checkpoint_path {shown(checkpoint_path)} cannot be read: {reason}"
        ) from exc
    if not resolved.is_relative_to(root):
        raise CheckpointUnusable(
            f"checkpoint_path {shown(checkpoint_path)} is outside the models root "
            f"{str(root)!r}; iserve only reads checkpoints under ISERVE_MODELS_ROOT"
        )
    if resolved.exists() and not resolved.is_dir():
        # A file of the checkpoint (its config.json, a weights file) given for it.
        raise CheckpointUnusable(
            f"checkpoint_path {shown(checkpoint_path)} is a file, not a directory: a "
            "checkpoint is the directory that holds config.json and the weights; give "
            f"{shown(str(Path(checkpoint_path).parent) or '.')}"
        )
    if not resolved.is_dir():
        raise CheckpointUnusable(
            f"checkpoint_path {shown(checkpoint_path)} is not a directory: it does not exist "
            f"under {str(root)!r}"
        )
    return resolved


def _check_entries_inside(checkpoint_path: str, directory: Path, root: Path) -> None:
    """CheckpointUnusable when an entry of ``directory``, a named chat template in it, or
    a weight file it names (in a subdirectory, through a shard index or
    ``transformers_weights``), is a link resolving outside ``root``. Weights it cannot
    name yet are left to validation. Other subdirectories are not read, so where they
    link is not checked: a models root given as the checkpoint was refused for a linked
    folder beside the checkpoints rather than for holding no config.json (a probe)."""
    entries = [entry for entry in directory.iterdir() if not entry.is_dir()]
    # The named chat templates too, which registration compiles and the gateway reads.
    templates = directory / CHAT_TEMPLATE_DIR
    if templates.is_dir():
        # The folder itself, then what is in it: a folder linked outside was passed over,
        # and every chat then failed on it (a tester).
        entries.append(templates)
        if templates.resolve().is_relative_to(root):
            entries += templates.iterdir()
    # Weights it cannot name: validation says what is wrong, before any is read.
    with contextlib.suppress(ValueError, OSError):
        entries += weight_files(directory)
    for entry in entries:
        if not entry.resolve().is_relative_to(root):
            raise CheckpointUnusable(
                f"checkpoint_path {shown(checkpoint_path)}: "
                f"{entry.relative_to(directory)} links outside the models root "
                f"{str(root)!r}; iserve only reads checkpoints under ISERVE_MODELS_ROOT"
            )


# ModelShape's names of ArchSpec's fields; the family (an enum there) is not compared.
_SHAPE_FIELDS = {"num_heads": "num_attention_heads", "family": ""}


def check_still_the_model(checkpoint_path: str, config: dict, shape: model_pb.ModelShape) -> None:
    """CheckpointChanged when the checkpoint's config.json describes another model than
    ``shape``, the model as registered (the checkpoint was rewritten since): the
    deployer reserved memory for that shape, and the profiler measures for it. A config
    that does not parse is left to the caller (the worker says why it cannot load it)."""
    try:
        spec = parse_config(config)
    except ValueError:
        return

    def registered(name: str) -> object:
        field = _SHAPE_FIELDS.get(name, name)
        return (getattr(shape, field) or None) if field else None

    unlike = unlike_model(spec, registered)
    if unlike is not None:
        raise CheckpointChanged(
            f"checkpoint {checkpoint_path!r} is no longer the model registered from it: "
            f"{unlike}; register it again (as a new model id, or after `iserve model "
            "delete`)"
        )


def check_weights_still_the_model(checkpoint_path: str, directory: Path, config: dict) -> None:
    """CheckpointChanged when the checkpoint's safetensors headers no longer hold every
    tensor its config implies in that shape (weights of another model copied over, a
    shard truncated, since registration checked them): every worker start from it would
    fail loading, on every device. Reads the headers only. A config that does not parse,
    or a file that cannot be opened, is left to the worker to report."""
    try:
        spec = parse_config(config)
    except ValueError:
        return
    again = "register it again (as a new model id, or after `iserve model delete`)"
    try:
        tensors = read_safetensors_index(directory)
    except InvalidCheckpoint as exc:
        raise CheckpointChanged(
            f"checkpoint {checkpoint_path!r} no longer reads as registered: {exc}; {again}"
        ) from exc
    except OSError:
        return
    for name, shape in spec.expected_tensors().items():
        info = tensors.get(name)
        if info is None or info.shape != shape:
            now = "is missing" if info is None else f"has shape {list(info.shape)} in {info.file}"
            raise CheckpointChanged(
                f"checkpoint {checkpoint_path!r} is no longer the model registered from it: "
                f"tensor {name!r} {now}, its config implies {list(shape)}; {again}"
            )
