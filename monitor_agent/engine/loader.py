"""Build a Transformer from a Hugging Face checkpoint directory.

The checkpoint is validated from its headers first (services.models), the model is
created on the meta device so no memory is spent on a random initialisation, and every
tensor is then copied name for name from the safetensors files, converted to the
requested dtype.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from monitor_agent.engine.model import Transformer
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
    checkpoint_dir: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu"
) -> Transformer:
    """The checkpoint's model with weights in ``dtype`` on ``device`` (no caches yet).

    Raises InvalidCheckpoint (or the config errors of services.models) when a tensor is
    missing, unexpected or of the wrong shape.
    """
    directory = Path(checkpoint_dir)
    checked = validate_checkpoint(directory, require_tokenizer=False)
    with torch.device("meta"):
        model = Transformer(checked.spec, dtype=torch_dtype(dtype))
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    if set(params) != set(checked.tensors):
        raise AssertionError("Transformer's parameters do not match ArchSpec.expected_tensors()")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, info in checked.tensors.items():
        by_file[info.file].append(name)
    for file_name, names in sorted(by_file.items()):
        with safe_open(str(directory / file_name), framework="pt", device="cpu") as f:
            for name in names:
                tensor = f.get_tensor(name)
                param = params[name]
                if tensor.shape != param.shape:
                    raise InvalidCheckpoint(
                        f"tensor {name!r} in {file_name} has shape {list(tensor.shape)}; "
                        f"expected {list(param.shape)}"
                    )
                param.copy_(tensor)
    return model.eval()
