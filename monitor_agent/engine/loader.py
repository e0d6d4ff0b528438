"""Build a Transformer, or one pipeline stage of it, from a Hugging Face checkpoint.

The checkpoint is validated from its headers first (services.models), the model is
created on the meta device so no memory is spent on a random initialisation, and each
parameter is then read from the safetensors files as ``ArchSpec.stage_weights`` says:
a whole tensor, or some rows of one (Falcon's fused ``query_key_value`` split into q, k
and v), converted to the requested dtype. Only the tensors of the stage's own layers (and
its embedding or head) are read, each through ``safe_open``'s lazy per-tensor access.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from monitor_agent.engine.model import Transformer
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
) -> Transformer:
    """The checkpoint's model with weights in ``dtype`` on ``device`` (no caches yet).

    With ``first_layer``/``layer_count`` only that pipeline stage is built and read: layers
    ``[first_layer, first_layer + layer_count)``, plus the embedding on the first stage and
    the final norm and LM head on the last. Raises InvalidCheckpoint (or the config errors
    of services.models) when a tensor is missing, unexpected or of the wrong shape, and
    ValueError for a stage outside the model's layers.
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
    model = model.to_empty(device=device)
    sources = checked.spec.stage_weights(model.first_layer, model.layer_count)
    params = dict(model.named_parameters())
    if set(params) != set(sources):
        raise AssertionError("Transformer's parameters do not match ArchSpec.stage_weights()")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, source in sources.items():
        by_file[checked.tensors[source.tensor].file].append(name)
    for file_name, names in sorted(by_file.items()):
        with safe_open(str(directory / file_name), framework="pt", device="cpu") as f:
            for name in names:
                tensor = _read(f, sources[name])
                param = params[name]
                if tensor.shape != param.shape:
                    raise InvalidCheckpoint(
                        f"tensor {sources[name].tensor!r} in {file_name} gives {name} shape "
                        f"{list(tensor.shape)}; expected {list(param.shape)}"
                    )
                param.copy_(tensor)
    return model.eval()


def _read(handle, source: WeightSource) -> torch.Tensor:
    """The tensor, or the concatenation of its row ranges, reading only those bytes."""
    if source.rows is None:
        return handle.get_tensor(source.tensor)
    rows = handle.get_slice(source.tensor)
    parts = [rows[start:stop] for start, stop in source.rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
