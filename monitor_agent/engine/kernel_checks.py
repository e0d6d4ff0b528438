"""Start-up self-checks of the packed and fused kernels the engine calls.

A fused kernel's answer depends on things iserve does not own: the layout torch packs for
the instruction set it dispatches to, the kernel's own arithmetic, a numerical identity
the engine leans on. So before a worker loads a model it runs every such kernel it is
about to use once, on a small random input, through the engine's own modules, and
compares the result with a reference computed without the kernel (float64 arithmetic on
the quantized values themselves). A kernel that disagrees is refused with
:class:`KernelCheckFailed`: the worker exits with that reason instead of streaming
garbage while reporting success. A wrongly packed int4 weight, for example, reads as
noise (a relative error near 100 %); the kernels' own rounding stays below 1 %.

What is checked, on the device the engine will run on:

* int8 weights (``Int8Linear``: ``_weight_int8pack_mm`` on CPU);
* int4 weights (``Int4Linear``: torch's own CPU packing read by
  ``_weight_int4pack_mm_for_cpu``; elsewhere the plain layout's dequantize path), over a
  weight of several quantization chunks with a partial last row block, in two group
  sizes and at 1 and 5 activation rows (the kernel's row blocks are 4);
* the float32 RMSNorm, computed through LayerNorm's fused kernel on ``[x, -x]``.

Each check costs a few milliseconds and runs once per process (cached).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from monitor_agent.engine.layers import RMSNorm
from monitor_agent.engine.quantize import (
    INT4_MID,
    Int4Linear,
    Int8Linear,
    int4_layout_for,
    quantize_int4_rows,
)

__all__ = ["KernelCheckFailed", "check_kernels"]

# Relative error (Frobenius norm of the difference over the reference's) a kernel may
# show: bfloat16 activations and outputs round at ~0.4 %; a misread layout is ~100 %.
TOLERANCE = 0.02
_IN_FEATURES = 256
# Two quantization chunks and a partial one of 48 rows, which is not a whole row block on
# any CPU path torch has (64 on AVX-512, 32 on AVX2 and plain builds).
_OUT_FEATURES = 2 * 256 + 48
_INT4_GROUPS = (32, 128)
_ACTIVATION_ROWS = (1, 5)


class KernelCheckFailed(RuntimeError):
    """A kernel the engine would use computes something other than its reference."""


def check_kernels(*, weight_quant: str, device: str | torch.device, dtype: torch.dtype) -> None:
    """Check every fused kernel an engine with ``weight_quant`` ("none", "int8", "int4")
    and model ``dtype`` runs on ``device``; raise KernelCheckFailed naming the first that
    disagrees with its reference."""
    device = torch.device(device)
    if dtype == torch.float32:
        _check_rms_norm(device)
    if weight_quant == "int8":
        _check_int8(device)
    elif weight_quant == "int4":
        _check_int4(device)


def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _where(device: torch.device) -> str:
    return f"{device} ({_cpu_capability()})" if device.type == "cpu" else str(device)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())


def _require(name: str, device: torch.device, error: float) -> None:
    if not error <= TOLERANCE:  # also refuses NaN
        raise KernelCheckFailed(
            f"{name} self-check failed on {_where(device)}: the kernel's result is "
            f"{error:.1%} away from the reference (at most {TOLERANCE:.0%} allowed); "
            f"refusing to serve with it (torch {torch.__version__})"
        )


@torch.no_grad()
def _random_linear(device: torch.device, seed: int) -> nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(_IN_FEATURES, _OUT_FEATURES)
    linear.weight.copy_(0.05 * torch.randn(linear.weight.shape, generator=generator))
    linear.bias.copy_(0.05 * torch.randn(linear.bias.shape, generator=generator))
    return linear.to(device)


def _activations(rows: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # bfloat16-exact values, so the kernels' cast of the input loses nothing.
    x = torch.randn(rows, _IN_FEATURES, generator=generator).bfloat16().float()
    return x.to(device)


@functools.cache
@torch.no_grad()
def _check_int8(device: torch.device) -> None:
    linear = _random_linear(device, seed=8)
    quantized = Int8Linear.from_linear(linear)
    weight = quantized.weight_int8.double() * quantized.scales.double()[:, None]
    for rows in _ACTIVATION_ROWS:
        x = _activations(rows, device, seed=rows)
        actual = quantized(x)
        expected = x.double() @ weight.T + linear.bias.double()
        _require("int8 weight kernel", device, _relative_error(actual, expected))


@functools.cache
@torch.no_grad()
def _check_int4(device: torch.device) -> None:
    linear = _random_linear(device, seed=4)
    for group in _INT4_GROUPS:
        quantized = Int4Linear.from_linear(linear, group)
        # The reference quantizes the same weight in one piece and dequantizes it here.
        q, scales, zeros = quantize_int4_rows(linear.weight.detach().float(), group)
        grouped = q.double().view(_OUT_FEATURES, -1, group) - INT4_MID
        weight = grouped * scales.double()[..., None] + zeros.double()[..., None]
        weight = weight.view(_OUT_FEATURES, _IN_FEATURES)
        layout = int4_layout_for(device, group)
        for rows in _ACTIVATION_ROWS:
            x = _activations(rows, device, seed=rows)
            actual = quantized(x)
            expected = x.double() @ weight.T + linear.bias.double()
            name = f"int4 weight kernel ({layout} layout, group {group})"
            _require(name, device, _relative_error(actual, expected))


@functools.cache
@torch.no_grad()
def _check_rms_norm(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, _IN_FEATURES, generator=generator)
    norm = RMSNorm(_IN_FEATURES, 1e-5, torch.float32)
    norm.weight.copy_(1 + 0.1 * torch.randn(_IN_FEATURES, generator=generator))
    actual = norm.to(device)(x.to(device))
    wide = x.double()
    expected = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)
    _require("float32 RMSNorm", device, _relative_error(actual, expected * norm.weight.double()))
