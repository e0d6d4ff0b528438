"""Build a Transformer, or one pipeline stage of it, from a Hugging Face checkpoint.

The checkpoint is validated from its headers first (services.models), the model is
created on the meta device so no memory is spent on a random initialisation, and each
parameter is then read from the safetensors files as ``ArchSpec.stage_weights`` says:
a whole tensor, or some rows of one (Falcon's fused ``query_key_value`` split into q, k
and v), converted to the requested dtype. Only the tensors of the stage's own layers (and
its embedding or head) are read, each through ``safe_open``'s lazy per-tensor access;
a tensor-parallel shard reads only its own rows or columns of the sharded tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from monitor_agent.engine.layers import DecoderLayer
from monitor_agent.engine.model import Transformer
from monitor_agent.engine.tensor_parallel import TensorShard, shard_modules, shard_sources
from services.models.arch import WeightSource
from services.models.checkpoint import InvalidCheckpoint, validate_checkpoint

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config-style dtype name ("float32", "bfloat16", "float16")."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(TORCH_DTYPES)}") from None


@torch.no_grad()
def load_model(
    checkpoint_dir: str | Path,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    first_layer: int = 0,
    layer_count: int | None = None,
    tensor_parallel: TensorShard | None = None,
    on_layer_loaded: Callable[[DecoderLayer], None] | None = None,
) -> Transformer:
    """The checkpoint's model with weights in ``dtype`` on ``device`` (no caches yet).

    With ``first_layer``/``layer_count`` only that pipeline stage is built and read: layers
    ``[first_layer, first_layer + layer_count)``, plus the embedding on the first stage and
    the final norm and LM head on the last. Raises InvalidCheckpoint (or the config errors
    of services.models) when a tensor is missing, unexpected or of the wrong shape, and
    ValueError for a stage outside the model's layers.

    With ``tensor_parallel`` the model is this tensor rank's shard (see
    :mod:`monitor_agent.engine.tensor_parallel`), and only its slices are read; ValueError
    when the model's heads or MLP width do not split that many ways.

    ``on_layer_loaded(layer)`` is called with each decoder layer once its weights are read
    (after sharding), before the next layer is allocated: the hook where quantization and
    pruning (:mod:`monitor_agent.engine.compression`) transform the model layer by layer.
    """
    directory = Path(checkpoint_dir)
    checked = validate_checkpoint(directory, require_tokenizer=False)
    with torch.device("meta"):
        model = Transformer(
            checked.spec,
            dtype=torch_dtype(dtype),
            first_layer=first_layer,
            layer_count=layer_count,
        )
        if tensor_parallel is not None:
            shard_modules(model, tensor_parallel)
    sources = checked.spec.stage_weights(model.first_layer, model.layer_count)
    if tensor_parallel is not None:
        sources = shard_sources(checked.spec, sources, tensor_parallel)
    if {name for name, _ in model.named_parameters()} != set(sources):
        raise AssertionError("Transformer's parameters do not match ArchSpec.stage_weights()")
    # One part at a time (the embedding, each layer, the final norm, the head) is allocated
    # and read, and each layer goes to on_layer_loaded before the next is read, so a
    # compressing hook keeps the full-precision model from ever being resident at once.
    for prefix, part in _parts(model):
        _allocate(part, device)
        compressing = on_layer_loaded is not None and isinstance(part, DecoderLayer)
        if not compressing:
            # Read straight into the input-major layout: no transient copy.
            store_input_major(part, keep_values=False)
        for name, param in part.named_parameters(prefix=prefix):
            source = sources[name]
            _load_parameter(param, name, directory / checked.tensors[source.tensor].file, source)
        if compressing:
            # The hook reads the plain layout fastest; what it leaves as float32
            # nn.Linear (structured pruning) is made input-major after it.
            on_layer_loaded(part)
            store_input_major(part)
    return model.eval()


def store_input_major(module: nn.Module, *, keep_values: bool = True) -> None:
    """Give every float32 CPU ``nn.Linear`` in ``module`` an input-major weight.

    The weight keeps its [out, in] shape but becomes the transpose of a contiguous
    [in, out] tensor. Whatever multiplies it (``F.linear``, quantization, pruning) sees
    the same values; MKL's float32 GEMM reads this layout faster when the activation has
    few rows: 1.2–1.9× for one to a few dozen rows at widths up to 1024 on the
    development VM (AVX-512), the same for one row of a weight streamed from memory,
    where bandwidth decides (docs/engine.md). bfloat16 and float16 gain nothing from it
    and keep the usual layout. ``keep_values=False`` only allocates (for a weight about
    to be read).
    """
    for child in module.modules():
        if type(child) is not nn.Linear:  # quantized and sparse Linears keep their own layout
            continue
        weight = child.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        if weight.stride(0) == 1:  # already input-major
            continue
        if keep_values:
            storage = weight.detach().t().contiguous()
        else:
            storage = torch.empty(weight.shape[::-1], dtype=weight.dtype, device=weight.device)
        child.weight = nn.Parameter(storage.t(), requires_grad=weight.requires_grad)


def _load_parameter(param: nn.Parameter, name: str, path: Path, source: WeightSource) -> None:
    """Copy ``source`` from the safetensors file at ``path`` into ``param``.

    The file is opened for this one tensor: a read can be a view of the file's memory map,
    and the map's pages stay resident while anything read from it lives, so one handle
    held across a layer's tensors would keep the whole layer's bytes mapped beside its
    copy.
    """
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        tensor = _read(handle, source)
        if tensor.shape != param.shape:
            raise InvalidCheckpoint(
                f"tensor {source.tensor!r} in {path.name} gives {name} shape "
                f"{list(tensor.shape)}; expected {list(param.shape)}"
            )
        _check_values(tensor, f"tensor {source.tensor!r} in {path.name}", param.dtype)
        param.copy_(tensor)


# Elements per pass of the values check: its only temporaries are two scalars.
_CHECK_CHUNK = 1 << 24


def _check_values(tensor: torch.Tensor, what: str, served: torch.dtype) -> None:
    """InvalidCheckpoint when ``tensor`` holds NaN or an infinity, or a value beyond what
    ``served`` holds (float32 weights past float16's 65504). A probe's checkpoint of NaN
    weights loaded and served: greedy requests got garbage, and sampled ones failed the
    whole batch they ran in with an INTERNAL error from torch.multinomial."""
    limit = torch.finfo(served).max
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_CHUNK):
        low, high = torch.aminmax(flat[start : start + _CHECK_CHUNK])  # NaN propagates
        low, high = float(low), float(high)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise InvalidCheckpoint(f"{what} holds NaN or infinite values")
        if max(-low, high) > limit:
            raise InvalidCheckpoint(
                f"{what} holds {max(-low, high):.3g}, beyond the {served} it is served in "
                f"(at most {limit:.3g}); serve it in another dtype"
            )


def _allocate(part: nn.Module, device: torch.device | str) -> None:
    """Give every parameter and buffer of ``part`` (built on the meta device) uninitialised
    storage on ``device``. ``Module.to_empty`` would do it through ``torch.empty_like``,
    whose meta path imports torch.fx's symbolic shapes and sympy (half a second of a
    worker's start-up on a small machine)."""
    for module in part.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            storage = torch.empty(param.shape, dtype=param.dtype, device=device)
            module.register_parameter(name, nn.Parameter(storage, param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))


def _parts(model: Transformer) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of the embedding, each decoder layer, the final norm and the head
    that ``model`` holds, in that order."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            yield from ((f"{name}.{j}", layer) for j, layer in enumerate(child))
        else:
            yield name, child


def _read(handle, source: WeightSource) -> torch.Tensor:
    """The tensor, or the concatenation of its row ranges, or a range of its columns,
    reading only those bytes."""
    if source.rows is None and source.columns is None:
        return handle.get_tensor(source.tensor)
    rows = handle.get_slice(source.tensor)
    ranges = source.rows or ((0, rows.get_shape()[0]),)
    if source.columns is None:
        parts = [rows[start:stop] for start, stop in ranges]
    else:
        first, last = source.columns
        parts = [rows[start:stop, first:last] for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
