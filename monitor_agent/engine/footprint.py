"""A fingerprint's layers timed with the full model's weight footprint (profiling, CPU).

A fingerprint keeps one to three of a model's decoder layers. On a CPU their weights fit
the last-level cache, which the full model's do not: a 24-layer model of hidden 512 in
float32 (11 MB a layer, 266 MB in all) streams every layer's weights from memory at each
decode step, while its 2-layer fingerprint (22 MB) finds them in a 32 MB L3. Its layer
clock then reads a decode layer 25-50 % faster than the full model's (measured on this
project's CPU: 0.12 against 0.25 ms at hidden 256, 0.46 against 0.62 ms at hidden 512),
and by a factor that changes with the model's width, the cache and whatever else shares
the memory bus, so no calibration fitted on some models carries to others.

A profiling worker that knows how many layers the full model's stage holds
(``--footprint-layers``) therefore keeps copies of its stage's layers and runs each
forward on the next copy in turn (``Transformer.layer_sets``), so that between two uses
of a copy a forward touches as many weight bytes as the full model's stage does, within
what the job reserves for them. Evicting the cache is not enough: a decode step over
weights that miss the cache still costs more the more bytes it streams (page walks and
DRAM pages). On this project's CPU (32 MB L3, hidden 512 float32, one thread) a layer
read among 66 MB of weights took 0.41-0.43 ms and among 264 MB 0.44-0.55 ms. With
copies up to twice the cache the fingerprints' decode layer read about 6 % faster than
the 24-layer models' (median over two runs of ``bench/estimate_cpu.py``), with copies up
to the full stage about the same (0.97 float, 1.01 int8, over three). The copies share the layers' KV caches and tensor-parallel
hooks, so every copy computes exactly what the original does; they are the engine's
profiling aid only, outside the memory account (which walks the model's registered
modules).

On CUDA the layers are left alone: a GPU's L2 (40-50 MB on an H100) holds no layer of a
model worth profiling there, and the copies would show in the allocator's peak, which is
that device's memory figure.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
from torch import nn

from monitor_agent.engine.kv_cache import LayerKVCache, kv_cache_bytes
from monitor_agent.engine.memory import parameter_and_buffer_bytes
from monitor_agent.engine.model import Transformer
from services.reservation import CPU_RUNTIME_MIB, MIB, RUNTIME_OVERHEAD_BYTES

log = logging.getLogger("iserve.engine")

# At most this many copies of a stage's layers (a deep model of narrow layers).
MAX_LAYER_SETS = 64
# The copies' bytes beyond the layers themselves stay within what a profiling job's
# reservation allows each rank beyond the measured runtime (services.reservation), so a
# worker never holds more than its job reserved.
MAX_COPY_BYTES = RUNTIME_OVERHEAD_BYTES - CPU_RUNTIME_MIB * MIB


def layer_sets_for(own_layers: int, footprint_layers: int, layer_bytes: float) -> int:
    """How many copies of a stage's ``own_layers`` layers (``layer_bytes`` each) a forward
    cycles through so that it touches what the full model's stage of
    ``footprint_layers`` layers does between two uses of a layer, within MAX_COPY_BYTES
    of copies and MAX_LAYER_SETS sets; 1 (the layers alone) when the stage already
    holds that many layers."""
    if own_layers < 1 or footprint_layers <= own_layers or layer_bytes <= 0:
        return 1
    stage_bytes = own_layers * layer_bytes
    affordable = 1 + int(MAX_COPY_BYTES // stage_bytes)
    return max(1, min(MAX_LAYER_SETS, affordable, math.ceil(footprint_layers / own_layers)))


def copy_weights(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose tensors (parameters, buffers and tensor attributes, such
    as fused or packed weights) are its own, and which shares everything else with it:
    its KV caches (LayerKVCache submodules) and plain attributes (a tensor-parallel
    all-reduce hook, the spec). Tensors that share a storage (q/k/v weights as views of
    the fused one) share the copy's."""
    return _copy_weights(module, {})


def _copy_weights(module: nn.Module, storages: dict[int, torch.UntypedStorage]) -> nn.Module:
    if isinstance(module, LayerKVCache):
        return module

    def twin_of(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        own = storages.setdefault(storage.data_ptr(), storage.clone())
        twin = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return twin.set_(own, tensor.storage_offset(), tensor.size(), tensor.stride())

    twin = copy.copy(module)
    twin._parameters = {
        name: None if p is None else nn.Parameter(twin_of(p.detach()), requires_grad=False)
        for name, p in module._parameters.items()
    }
    twin._buffers = {name: None if b is None else twin_of(b) for name, b in module._buffers.items()}
    twin._modules = {
        name: None if m is None else _copy_weights(m, storages)
        for name, m in module._modules.items()
    }
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            setattr(twin, name, twin_of(value))
    return twin


def layer_bytes(layers: nn.ModuleList) -> float:
    """Mean bytes of one layer's weights, as the engine's memory account counts them
    (its parameters and buffers, each storage once, the KV cache left out): what a
    forward reads of it."""
    weights = parameter_and_buffer_bytes(layers) - kv_cache_bytes(layers)
    return weights / max(1, len(layers))


def time_with_footprint(stage: Transformer, footprint_layers: int) -> int:
    """Have ``stage``'s forwards cycle through copies of its layers so that they run with
    the weight footprint of a stage of ``footprint_layers`` layers (``layer_sets_for``);
    returns how many sets it runs on (1: its own)."""
    own = len(stage.layers)
    each = layer_bytes(stage.layers)
    count = layer_sets_for(own, footprint_layers, each)
    stage.use_layer_sets([copy_weights(stage.layers) for _ in range(count - 1)])
    if footprint_layers > own:
        log.info(
            "layer clock: %d layer(s) of %.1f MiB timed among %d copies (%.0f MiB), for the "
            "full model's %d-layer stage (%.0f MiB)",
            own,
            each / MIB,
            count,
            count * own * each / MIB,
            footprint_layers,
            footprint_layers * each / MIB,
        )
    return count
