"""Weight-only int8 and int4 quantization: drop-in replacements for ``nn.Linear``.

Only the weights are quantized; activations stay in the model dtype and every output is
returned in the input's dtype.

* :class:`Int8Linear`: one symmetric scale per output channel, ``absmax / 127``, stored
  in bfloat16; the weight is quantized with that rounded scale, so the scale's rounding
  costs nothing beyond int8's own half-step error. 1 byte per weight + 2 per row.
* :class:`Int4Linear`: asymmetric, one bfloat16 scale and zero per group of
  ``group_size`` consecutive input weights of a row (the group's range, widened to hold
  0, over 15 levels, with an integer zero point so 0 stays (almost) exactly 0: pruned
  weights stay pruned). Two 4-bit values per byte of a uint8 tensor: 0.5 bytes per weight
  + 4 per group.

On CPU the matmul runs in torch's fused weight-only kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``), which read the packed weights and accumulate in float32
from bfloat16 activations: activations of other dtypes are cast to bfloat16 for the
kernel and the output cast back. Measured on one core of the development machine at a
Llama-7B 4096×4096 projection, one token: fp32 ``F.linear`` 3.9 ms, bf16 3.7 ms, the
int8 kernel 1.5 ms, the int4 kernel 1.3 ms; at 64 tokens the kernels are ~1.5× slower
than fp32 (~23 vs ~35 ms). Dequantizing in Python instead (unpack, scale, ``F.linear``)
took 30–100 ms per token, and ``torch._int_mm`` would need int8 activations
(a different, lossier scheme). Elsewhere (CUDA, or shapes the kernels cannot take: the
int8 kernel crashes the process for an in_features not divisible by 16, the int4 kernel
takes groups of 32..256) forward dequantizes the weight and uses ``F.linear``.

The int4 bytes come in one of two layouts, chosen when a Linear is quantized:

* ``"cpu-kernel"``: whatever ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` writes
  for the kernel that will read it. That layout depends on the instruction set torch
  dispatches to (rows in blocks of 64 on AVX-512, of 32 on AVX2 and plain builds), so
  iserve never writes it by hand: torch packs, torch reads. Rows are padded with zeros to
  a multiple of 16, which the conversion requires.
* ``"plain"``: row-major, column 2j in the low nibble of byte j and column 2j+1 in the
  high one. iserve's own format, read only by :meth:`Int4Linear.dequantize`; used where
  the CPU kernel does not run.

:mod:`monitor_agent.engine.kernel_checks` runs each kernel once on a random matrix at
start-up and refuses to serve a quantization whose kernel disagrees with its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine_rules import INT4_MIN_GROUP

__all__ = [
    "INT4_GROUP_SIZES",
    "INT4_LAYOUTS",
    "Int4Linear",
    "Int8Linear",
    "int4_group_size",
    "int4_layout_for",
    "pack_int4_plain",
    "quantize_int4_rows",
    "quantize_linears",
    "unpack_int4_plain",
]

SCALE_DTYPE = torch.bfloat16
_INT8_MAX = 127
_INT4_LEVELS = 15
INT4_MID = 8  # the CPU kernel dequantizes as (q - 8) · scale + zero
# torch's CPU int4 conversion takes an output width divisible by 16.
_KERNEL_ROW_MULTIPLE = 16
# Rows quantized at a time: bounds the float32 temporaries. torch's CPU packing works on
# row blocks of at most 64, so converting 256 rows at a time equals converting the whole
# weight; kernel_checks verifies that on the running CPU with a weight of several chunks.
_CHUNK_ROWS = 256
# Group sizes the CPU int4 kernel takes; smaller groups (inputs not divisible by 32) run
# on the dequantizing path.
INT4_GROUP_SIZES = (32, 64, 128, 256)
_MIN_INT4_GROUP = INT4_MIN_GROUP  # what services.engine_rules checks before a launch
INT4_LAYOUTS = ("cpu-kernel", "plain")

_aten = torch.ops.aten
_HAS_INT8_KERNEL = hasattr(_aten, "_weight_int8pack_mm")
_HAS_INT4_KERNEL = hasattr(_aten, "_weight_int4pack_mm_for_cpu") and hasattr(
    _aten, "_convert_weight_to_int4pack_for_cpu"
)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Int8Linear(nn.Module):
    """``y = x · (q · scale)ᵀ + bias`` with q int8 [out, in] and scale [out] per row."""

    def __init__(
        self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize ``linear``'s weight per output channel; the bias keeps its dtype."""
        weight = linear.weight.detach()
        values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scales = torch.empty(weight.shape[0], dtype=SCALE_DTYPE, device=weight.device)
        for start in range(0, weight.shape[0], _CHUNK_ROWS):
            rows = weight[start : start + _CHUNK_ROWS].float()
            absmax = rows.abs().amax(dim=1)
            chunk_scales = (absmax / _INT8_MAX).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
            scales[start : start + _CHUNK_ROWS] = chunk_scales
            rounded = torch.round(rows / scales[start : start + _CHUNK_ROWS].float()[:, None])
            values[start : start + _CHUNK_ROWS] = rounded.clamp_(-_INT8_MAX, _INT8_MAX)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(values, scales, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] the quantized values stand for, in ``dtype``."""
        return (self.weight_int8.float() * self.scales.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _HAS_INT8_KERNEL and x.device.type == "cpu" and self.in_features % 16 == 0:
            flat = x.reshape(-1, self.in_features).to(SCALE_DTYPE)
            out = _aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
            out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.weight_int8.to(x.dtype)) * self.scales.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(nn.Module):
    """``y = x · Wᵀ + bias`` with W [out, in] in 4-bit groups along the input dimension.

    ``packed`` is uint8 [rows, in / 2] in ``layout`` (see the module docstring; rows is
    ``out`` rounded up to 16 for "cpu-kernel", ``out`` for "plain"); ``scales_and_zeros``
    is [in / group_size, rows, 2] with W[n, k] = (q[n, k] − 8) · scale + zero for k's
    group (the CPU kernel's format).
    """

    def __init__(
        self,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        out_features: int,
        group_size: int,
        layout: str,
    ) -> None:
        super().__init__()
        if layout not in INT4_LAYOUTS:
            raise ValueError(f"int4 layout must be one of {INT4_LAYOUTS}, got {layout!r}")
        self.out_features = out_features
        self.in_features = packed.shape[1] * 2
        self.group_size = group_size
        self.layout = layout
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls, linear: nn.Linear, group_size: int = 128, *, layout: str | None = None
    ) -> Int4Linear:
        """Quantize ``linear``'s weight in groups of ``int4_group_size(in, group_size)``,
        packed in ``layout`` (default: :func:`int4_layout_for` the weight's device)."""
        weight = linear.weight.detach()
        out_features, in_features = weight.shape
        group = int4_group_size(in_features, group_size)
        layout = layout or int4_layout_for(weight.device, group)
        if layout == "cpu-kernel" and not (
            _HAS_INT4_KERNEL and weight.device.type == "cpu" and group in INT4_GROUP_SIZES
        ):
            raise ValueError(
                f"the CPU int4 kernel cannot take a {weight.device.type} weight in groups of "
                f"{group}; use the plain layout"
            )
        rows = _round_up(out_features, _KERNEL_ROW_MULTIPLE if layout == "cpu-kernel" else 1)
        packed = torch.empty(rows, in_features // 2, dtype=torch.uint8, device=weight.device)
        scales_and_zeros = torch.empty(
            in_features // group, rows, 2, dtype=SCALE_DTYPE, device=weight.device
        )
        for start in range(0, rows, _CHUNK_ROWS):
            chunk = weight[start : start + _CHUNK_ROWS].float()
            height = min(_CHUNK_ROWS, rows - start)
            if chunk.shape[0] < height:  # the zero rows that pad out the kernel's width
                chunk = torch.cat((chunk, chunk.new_zeros(height - chunk.shape[0], in_features)))
            q, scales, zeros = quantize_int4_rows(chunk, group)
            if layout == "cpu-kernel":
                packed[start : start + height] = _aten._convert_weight_to_int4pack_for_cpu(
                    q.to(torch.int32), 1
                )
            else:
                packed[start : start + height] = pack_int4_plain(q)
            scales_and_zeros[:, start : start + height] = torch.stack(
                (scales, zeros), -1
            ).transpose(0, 1)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(
            packed,
            scales_and_zeros,
            bias,
            out_features=out_features,
            group_size=group,
            layout=layout,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] the quantized values stand for, in ``dtype``.

        For the "cpu-kernel" layout this asks the kernel itself: the float32 product of an
        identity matrix with the packed weight, O(in² · out) work, for checks and tests
        rather than serving."""
        if self.layout == "cpu-kernel":
            identity = torch.eye(self.in_features, dtype=torch.float32)
            transposed = _aten._weight_int4pack_mm_for_cpu(
                identity, self.packed, self.group_size, self.scales_and_zeros.float()
            )
            return transposed.t()[: self.out_features].to(dtype)
        q = unpack_int4_plain(self.packed).float()
        rows = q.shape[0]
        groups = q.view(rows, -1, self.group_size)
        scales, zeros = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)
        weight = (groups - INT4_MID) * scales[..., None] + zeros[..., None]
        return weight.view(rows, self.in_features)[: self.out_features].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "cpu-kernel":
            if x.device.type != "cpu":
                raise RuntimeError(
                    f"int4 weights packed for the CPU kernel cannot run on {x.device}"
                )
            flat = x.reshape(-1, self.in_features).to(SCALE_DTYPE)
            out = _aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group_size, self.scales_and_zeros
            )
            out = out[:, : self.out_features].to(x.dtype)
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.dequantize(x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, layout={self.layout}"
        )


def int4_layout_for(device: torch.device, group: int) -> str:
    """The int4 layout a weight on ``device`` in groups of ``group`` is packed in: the CPU
    kernel's where that kernel can run it, else the plain one."""
    if _HAS_INT4_KERNEL and device.type == "cpu" and group in INT4_GROUP_SIZES:
        return "cpu-kernel"
    return "plain"


def quantize_int4_rows(
    weight: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [rows, in], scales [rows, in / group], zeros [same]) of float32 ``weight``
    with weight ≈ (q − 8) · scale + zero per group, scales and zeros rounded to bfloat16."""
    rows, in_features = weight.shape
    grouped = weight.view(rows, in_features // group, group)
    low = grouped.amin(dim=-1).clamp_max(0)
    high = grouped.amax(dim=-1).clamp_min(0)
    scales = ((high - low) / _INT4_LEVELS).to(SCALE_DTYPE).float()
    safe = torch.where(scales > 0, scales, 1.0)
    zero_points = torch.round(-low / safe).clamp_(0, _INT4_LEVELS)
    q = torch.round(grouped / safe[..., None]).add_(zero_points[..., None])
    q = q.clamp_(0, _INT4_LEVELS).to(torch.uint8).view(rows, in_features)
    zeros = (INT4_MID - zero_points) * scales
    return q, scales.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE)


def int4_group_size(in_features: int, requested: int) -> int:
    """``requested`` (a power of two) or, when it does not divide ``in_features``, the
    largest power of two below it that does; ValueError below 8."""
    if requested < _MIN_INT4_GROUP or requested & (requested - 1):
        raise ValueError(f"int4 group size must be a power of two >= 8, got {requested}")
    group = requested
    while in_features % group:
        group //= 2
    if group < _MIN_INT4_GROUP:
        raise ValueError(
            f"int4 quantization needs in_features divisible by {_MIN_INT4_GROUP}, got {in_features}"
        )
    return group


def pack_int4_plain(q: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, in / 2] holding q (integers 0..15, [rows, in], in even) two per byte:
    column 2j in the low nibble of byte j, column 2j + 1 in the high one."""
    rows, columns = q.shape
    if columns % 2:
        raise ValueError(f"pack_int4_plain needs an even number of columns, got {columns}")
    pairs = q.to(torch.uint8).view(rows, columns // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4_plain(packed: torch.Tensor) -> torch.Tensor:
    """The uint8 [rows, in] values (0..15) that :func:`pack_int4_plain` packed."""
    rows, half_columns = packed.shape
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(rows, half_columns * 2)


def quantize_linears(module: nn.Module, kind: str, *, int4_group: int = 128) -> None:
    """Replace every ``nn.Linear`` inside ``module`` (not ``module`` itself) with its
    ``kind`` ("int8" or "int4") counterpart, in place."""
    if kind not in ("int8", "int4"):
        raise ValueError(f"weight quantization must be 'int8' or 'int4', got {kind!r}")
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if kind == "int8":
                replacement: nn.Module = Int8Linear.from_linear(child)
            else:
                replacement = Int4Linear.from_linear(child, int4_group)
            setattr(parent, name, replacement)
