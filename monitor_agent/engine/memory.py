"""The memory a worker reports: weights + KV cache + peak activations, in bytes.

On CPU torch keeps no allocator statistics (the process RSS also holds the Python
interpreter, torch's libraries and allocator slack), so the engine keeps its own
account:

* weights: the bytes of every parameter, and the bytes of the other buffers (RoPE
  tables), each storage counted once;
* KV cache: the bytes of every LayerKVCache buffer (int8 values and their scales when
  quantized);
* activations: **measured**. A forward pass that could set a new peak runs under torch's
  profiler with memory profiling on (:func:`measure_peak_allocation`), which records
  every CPU tensor allocation and free of the pass; the largest running total is the
  pass's peak, and the account keeps the largest seen. Which passes could: those whose
  shape is larger, by :func:`forward_activation_bytes` (an estimate from the pass's
  shape, used only to rank shapes), than any pass measured so far by at least
  :data:`REMEASURE_GROWTH`, so a worker measures a few passes (each prompt length's
  first prefill, a batch larger than before, decodes far longer than before), not every
  step. Temporaries inside a single kernel (oneDNN's scratch) are not seen.

On CUDA the worker reports ``torch.cuda.max_memory_allocated`` as its peak instead,
which measures the same things, and nothing runs under the profiler.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import nn
from torch.autograd import DeviceType, profiler

from monitor_agent.engine.kv_cache import kv_cache_bytes
from services.models.arch import ArchSpec

_FLOAT32_BYTES = 4
# A pass is measured when its shape's estimate exceeds the largest measured one by this
# factor (the first pass always is): a decode whose context grows a token a step is
# measured again each time it has grown a tenth, not at every step.
REMEASURE_GROWTH = 1.1

T = TypeVar("T")


def start_profiler_here() -> None:
    """Start torch's profiler library (Kineto) on this thread, the one that loaded torch,
    with its own log lines off. Started first by the engine's generation thread, Kineto
    printed "ERROR: External init callback must run in same thread as registerClient"
    into the worker's log, and "USDT: ... profiler_start/stop" at every measured pass:
    lines that read as failures and say nothing an operator can act on. Its level is
    set through ``KINETO_LOG_LEVEL`` (6: above its highest, so none), unless given."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    if not profiler._is_profiler_enabled:
        measure_peak_allocation(lambda: None)


def measure_peak_allocation(run: Callable[[], T]) -> tuple[T, int | None]:
    """``run()``'s result and the peak bytes of CPU tensors it had allocated at once
    (allocations less frees, in the order torch's profiler recorded them; the profiler
    reports no free of a block allocated before it started, so tensors older than the
    call do not lower it; a kernel's own scratch that bypasses torch's allocator is not
    seen). None, with ``run()`` run plainly, while a profiler is already on (a user
    profiling the worker)."""
    if profiler._is_profiler_enabled:
        return run(), None
    with profiler.profile(profile_memory=True, record_shapes=False, with_stack=False) as prof:
        result = run()
    live = peak = 0
    ours: dict[int, int] = {}  # the blocks this call allocated, by address, still live
    for _, address, nbytes in _cpu_allocations(prof):
        if nbytes > 0:
            if address is not None:
                ours[address] = nbytes
            live += nbytes
        elif address is None:  # no addresses: every free counts
            live += nbytes
        elif address in ours:
            live -= ours.pop(address)
        peak = max(peak, live)
    return result, peak


def _cpu_allocations(prof: profiler.profile) -> list[tuple[int, int | None, int]]:
    """(time ns, address, +bytes allocated or -bytes freed) of each CPU tensor block the
    profiler recorded, in order. The profiler also records the free of a block an earlier
    profiled call allocated (it keeps their sizes), which is not this call's: a 0.5 MiB
    result of one measured pass freed during the next took 0.5 MiB off that one's peak.
    So the address of each, from its event tree (``experimental_event_tree``); where
    this torch has none, every free counts, as before."""
    try:
        from torch._C._profiler import _EventType

        out, pending = [], list(prof.kineto_results.experimental_event_tree())
        while pending:
            node = pending.pop()
            pending.extend(node.children)
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                fields = node.extra_fields
                out.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        return sorted(out, key=lambda change: (change[0], change[2]))
    except (ImportError, AttributeError):
        # Each allocation (+bytes) and free (-bytes) as one "[memory]" event at its own
        # time; no address, so each a block of its own.
        return sorted(
            (
                (event.start_ns(), None, event.nbytes())
                for event in prof.kineto_results.events()
                if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
            ),
            key=lambda change: (change[0], change[2]),
        )


def forward_activation_bytes(
    spec: ArchSpec,
    dtype_bytes: int,
    *,
    rows: int,
    tokens_per_row: int,
    kv_len: int,
    logit_rows: int,
) -> int:
    """Estimated peak bytes of activations of one forward pass of ``rows`` sequences of
    ``tokens_per_row`` new tokens each, attending to ``kv_len`` positions, that returns
    logits for ``logit_rows`` tokens: the size of a pass's shape, which decides which
    passes are measured (never reported itself). It assumes activations in the model
    dtype with attention scores and sampled logits in float32, and counts within one
    layer the residual stream plus the larger of the attention block (q, k, v before and
    after RoPE, the keys/values read back from the cache, scores and mask) and the MLP
    block (gate, up and their product), or, after the last layer, the logits."""
    tokens = rows * tokens_per_row
    q_dim = spec.num_heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    hidden = tokens * spec.hidden_size * dtype_bytes
    residual = 3 * hidden  # x, its norm, the block's output
    attention = (
        2 * tokens * (q_dim + 2 * kv_dim) * dtype_bytes  # q, k, v before and after RoPE
        + 2 * rows * kv_len * kv_dim * dtype_bytes  # keys and values read from the cache
        + rows * spec.num_heads * tokens_per_row * kv_len * _FLOAT32_BYTES  # scores
        + rows * tokens_per_row * kv_len  # boolean mask
        + tokens * q_dim * dtype_bytes  # attention output
    )
    mlp = 3 * tokens * spec.intermediate_size * dtype_bytes
    logits = logit_rows * spec.vocab_size * (dtype_bytes + _FLOAT32_BYTES)
    return max(residual + max(attention, mlp), hidden + logits)


def return_freed_memory() -> None:
    """Give the heap pages freed so far back to the operating system (glibc's
    ``malloc_trim``; nothing elsewhere).

    Loading frees a lot: each layer's full-precision weights once it is compressed, dtype
    conversion temporaries. glibc keeps some of that mapped for reuse, by chance ~0-200 MB
    on a 7B-wide layer, which the process RSS would show as if the model still held it.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return


def parameter_and_buffer_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers (KV cache included), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


@dataclass
class MemoryAccount:
    """Bytes of a loaded engine's tensors; ``observe_forward`` raises the activation peak."""

    weight_bytes: int  # parameters and non-cache buffers
    kv_cache_bytes: int
    peak_activation_bytes: int = 0
    # The largest shape estimate (forward_activation_bytes) of a pass measured so far.
    measured_shape_bytes: int = 0

    def should_measure(self, shape_bytes: int) -> bool:
        """Whether a pass of this shape estimate could set a new peak (module docstring)."""
        return shape_bytes > self.measured_shape_bytes * REMEASURE_GROWTH

    def observe_measured(self, shape_bytes: int, peak_bytes: int) -> None:
        """Record a measured pass: its shape estimate and the peak it allocated."""
        self.measured_shape_bytes = max(self.measured_shape_bytes, shape_bytes)
        self.observe_forward(peak_bytes)

    @classmethod
    def of_model(cls, model: nn.Module) -> MemoryAccount:
        cache = kv_cache_bytes(model)
        return cls(weight_bytes=parameter_and_buffer_bytes(model) - cache, kv_cache_bytes=cache)

    def observe_forward(self, activation_bytes: int) -> None:
        if activation_bytes > self.peak_activation_bytes:
            self.peak_activation_bytes = activation_bytes

    @property
    def resident_bytes(self) -> int:
        """Weights + KV cache + the largest activation peak so far."""
        return self.weight_bytes + self.kv_cache_bytes + self.peak_activation_bytes
