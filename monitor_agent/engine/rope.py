"""Rotary position embeddings: full or partial, in either pairing convention.

* rotate-half (Llama, Mistral, Qwen2, Falcon): dimension i pairs with i + d/2;
* interleaved (GPT-J's "rotate every two"): dimension 2i pairs with 2i + 1.

Only the first ``rotary_dim`` dimensions of a head rotate (GPT-J rotates 64 of 256); the
rest pass through. The cos/sin tables are computed once, in float32, for every position
the engine may see, already laid out for their convention; a forward pass only gathers
rows by position.

The sin table is signed: each dimension's sin carries the sign its partner takes in the
rotation (−sin for the first of a pair, +sin for the second), so a rotation is
``x·cos + partner(x)·sin`` with ``partner`` a single roll (rotate-half) or pair swap
(interleaved), four tensor ops instead of the seven of slicing, negating and
concatenating. ``(−a)·s`` and ``a·(−s)`` round identically, so the result is bit for bit
the textbook ``x·cos + rotate_half(x)·sin``.
"""

from __future__ import annotations

import math

import torch

from services.models.rope_scaling import RopeScaling


def inverse_frequencies(
    rotary_dim: int,
    theta: float,
    device: torch.device | str = "cpu",
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """The rotary frequencies (radians per position) of each rotating pair, float32,
    stretched as ``scaling`` says (see :class:`RopeScaling`)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (exponents / rotary_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep the short wavelengths, stretch the long ones by the factor, and blend
    # in between with a weight linear in (pretrained context / wavelength).
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    stretched = inv_freq / scaling.factor
    weight = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    # Associated as transformers does, so that the tables agree with it to the bit.
    blended = (1 - weight) * inv_freq / scaling.factor + weight * inv_freq
    long = wavelength > original / scaling.low_freq_factor
    short = wavelength < original / scaling.high_freq_factor
    return torch.where(long, stretched, torch.where(short, inv_freq, blended))


def rope_tables(
    rotary_dim: int,
    max_seq_len: int,
    theta: float,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    interleaved: bool = False,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables of shape [max_seq_len, rotary_dim] (see the module
    docstring for the sin table's signs)."""
    inv_freq = inverse_frequencies(rotary_dim, theta, device, scaling)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)
    if interleaved:
        angles = torch.repeat_interleave(freqs, 2, dim=-1)
        signs = torch.tensor([-1.0, 1.0], device=device).repeat(rotary_dim // 2)
    else:
        angles = torch.cat((freqs, freqs), dim=-1)
        signs = torch.tensor([-1.0, 1.0], device=device).repeat_interleave(rotary_dim // 2)
    return angles.cos().to(dtype), (angles.sin() * signs).to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, heads, T, head_dim] by cos and signed
    sin [B, 1, T, rotary_dim]; the remaining dims pass through unchanged."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotating, passing = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((_rotate(rotating, cos, sin, interleaved), passing), dim=-1)
    return _rotate(x, cos, sin, interleaved)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    if interleaved:
        partner = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        partner = x.roll(x.shape[-1] // 2, dims=-1)
    return x * cos + partner * sin
