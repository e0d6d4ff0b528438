"""A fingerprint's layers timed with the full model's cache footprint (profiling, CPU).

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
of a copy a forward touches as many weight bytes as the full model's stage does, up to
twice the last-level cache: what is in the cache when a layer runs is what the full
model would have left there. The copies share the layers' KV caches and tensor-parallel
hooks, so every copy computes exactly what the original does; they are the engine's
profiling aid only, outside the memory account (which walks the model's registered
modules). With the same layers cycled on the same prompt, a fingerprint's decode layer
reads within a few percent of the full model's at hidden 256 and 512 (the bench's
``bench/estimate_cpu.py`` compares them).

On CUDA the layers are left alone: a GPU's L2 (40-50 MB on an H100) holds no layer of a
model worth profiling there, and the copies would show in the allocator's peak, which is
that device's memory figure.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from pathlib import Path

import torch
from torch import nn

from monitor_agent.engine.kv_cache import LayerKVCache, kv_cache_bytes
from monitor_agent.engine.memory import parameter_and_buffer_bytes
from monitor_agent.engine.model import Transformer
from services.reservation import CPU_RUNTIME_MIB, MIB, RUNTIME_OVERHEAD_BYTES

log = logging.getLogger("iserve.engine")

# A forward touches up to this many times the last-level cache between two uses of one
# copy: enough that nothing of a copy is left there when it runs again, whatever the
# cache's replacement policy, and no more (the copies cost memory).
CACHE_MULTIPLE = 2
# At most this many copies of a stage's layers (a narrow model on a large cache).
MAX_LAYER_SETS = 64
# The copies' bytes beyond the layers themselves stay within what a profiling job's
# reservation allows each rank beyond the measured runtime (services.reservation), so a
# worker never holds more than its job reserved.
MAX_COPY_BYTES = RUNTIME_OVERHEAD_BYTES - CPU_RUNTIME_MIB * MIB

_SIZE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_size(text: str) -> int:
    """Bytes of a sysfs cache size such as ``32768K``; 0 when unreadable."""
    text = text.strip().upper()
    if not text:
        return 0
    scale = _SIZE_SUFFIX.get(text[-1], 1)
    digits = text[:-1] if text[-1] in _SIZE_SUFFIX else text
    return int(digits) * scale if digits.isdigit() else 0


def last_level_cache_bytes(core: int | None = None, sys_root: Path = Path("/sys")) -> int:
    """Bytes of the last-level cache of CPU ``core`` (the first core this process may run
    on when None), as the kernel describes it (``/sys/devices/system/cpu/cpuN/cache``:
    the highest level's data or unified cache); else glibc's ``sysconf`` figure for L3,
    then L2; 0 when neither says."""
    if core is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0}
        core = min(allowed, default=0)
    best_level, best_bytes = 0, 0
    for index in sorted((sys_root / f"devices/system/cpu/cpu{core}/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size and level >= best_level:
            best_level, best_bytes = level, max(size, best_bytes if level == best_level else 0)
    if best_bytes:
        return best_bytes
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name) if name in os.sysconf_names else 0
        except (OSError, ValueError):
            size = 0
        if size and size > 0:
            return int(size)
    return 0


def layer_sets_for(
    own_layers: int, footprint_layers: int, layer_bytes: float, cache_bytes: int
) -> int:
    """How many copies of a stage's ``own_layers`` layers (``layer_bytes`` each) a forward
    cycles through so that it touches what the full model's stage of
    ``footprint_layers`` layers does between two uses of a layer, capped at
    CACHE_MULTIPLE x ``cache_bytes`` and at MAX_COPY_BYTES of copies; 1 (the layers
    alone) when the stage already holds that many layers or the cache is unknown."""
    if own_layers < 1 or footprint_layers <= own_layers or cache_bytes <= 0 or layer_bytes <= 0:
        return 1
    stage_bytes = own_layers * layer_bytes
    target = min(footprint_layers * layer_bytes, CACHE_MULTIPLE * cache_bytes)
    affordable = 1 + int(MAX_COPY_BYTES // stage_bytes)
    return max(1, min(MAX_LAYER_SETS, affordable, math.ceil(target / stage_bytes)))


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
    the cache footprint of a stage of ``footprint_layers`` layers (``layer_sets_for``,
    this process's last-level cache); returns how many sets it runs on (1: its own)."""
    own = len(stage.layers)
    each = layer_bytes(stage.layers)
    cache = last_level_cache_bytes()
    count = layer_sets_for(own, footprint_layers, each, cache)
    stage.use_layer_sets([copy_weights(stage.layers) for _ in range(count - 1)])
    if footprint_layers > own:
        log.info(
            "layer clock: %d layer(s) of %.1f MiB timed among %d copies (%.0f MiB), for the "
            "full model's %d-layer stage and a %.0f MiB last-level cache%s",
            own,
            each / MIB,
            count,
            count * own * each / MIB,
            footprint_layers,
            cache / MIB,
            "" if cache else " (unknown: the layers are timed alone)",
        )
    return count
