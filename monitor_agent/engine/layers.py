"""The building blocks of the decoder: norms, attention, MLP and one decoder layer.

Every block reads its shape from the ArchSpec once, in its constructor, and from its own
attributes afterwards, so transforms (tensor-parallel sharding, structured pruning,
quantization) can change a block in place; see model.py for the contract they rely on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from monitor_agent.engine.kv_cache import CacheAddress, LayerKVCache
from monitor_agent.engine.rope import apply_rope
from services.models.arch import ArchSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as Hugging Face Llama does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(spec: ArchSpec, dtype: torch.dtype) -> nn.Module:
    """RMSNorm (weight) or LayerNorm (weight and bias), as the spec says."""
    if spec.norm_kind == "rms":
        return RMSNorm(spec.hidden_size, spec.norm_eps, dtype)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, dtype=dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, rotary positions and a static KV cache.

    ``n_heads``, ``n_kv_heads`` and ``head_dim`` are read in forward, never the spec, so a
    tensor-parallel shard can hold a subset of the heads. The output goes through
    ``self.reduce`` (identity here; an all-reduce under tensor parallelism).
    """

    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.n_heads = spec.num_heads
        self.n_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.rotary_interleaved = spec.rotary_interleaved
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_out, bias=spec.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_out, bias=spec.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_out, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_out, hidden, bias=spec.attn_out_bias, dtype=dtype)
        self.kv_cache: LayerKVCache | None = None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Combine partial outputs across tensor-parallel ranks; identity on one rank."""
        return x

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        address: CacheAddress,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin, interleaved=self.rotary_interleaved)
        k = apply_rope(k, cos, sin, interleaved=self.rotary_interleaved)
        assert self.kv_cache is not None, "call Transformer.setup_caches before forward"
        keys, values = self.kv_cache.update(address, k, v)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads
        )
        out = out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)
        return self.reduce(self.o_proj(out))


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    # GPT-J's "gelu_new": 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) when gated (SwiGLU), down(act(up(x))) otherwise.

    Every weight is an ``nn.Linear`` submodule (``gate_proj`` is None when not gated), so
    quantization can swap them and structured pruning can shrink the inner width. The
    output goes through ``self.reduce`` like the attention's.
    """

    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.gate_proj = (
            nn.Linear(hidden, inner, bias=bias, dtype=dtype) if spec.gated_mlp else None
        )
        self.up_proj = nn.Linear(hidden, inner, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, dtype=dtype)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Combine partial outputs across tensor-parallel ranks; identity on one rank."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            inner = self.act(self.up_proj(x))
        else:
            inner = self.act(self.gate_proj(x)) * self.up_proj(x)
        return self.reduce(self.down_proj(inner))


class DecoderLayer(nn.Module):
    """One block: sequential (Llama) or parallel (Falcon, GPT-J) attention and MLP.

    ``attn_norm`` feeds the attention; ``mlp_norm`` feeds the MLP and is None when both
    read the attention's norm (Falcon-7B, GPT-J).
    """

    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.parallel_residual = spec.parallel_residual
        self.attn_norm = make_norm(spec, dtype)
        self.self_attn = Attention(spec, dtype)
        self.mlp_norm = None if spec.shared_layer_norm else make_norm(spec, dtype)
        self.mlp = MLP(spec, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        address: CacheAddress,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        normed = self.attn_norm(x)
        attended = self.self_attn(normed, cos, sin, address, mask)
        if not self.parallel_residual:
            h = x + attended
            assert self.mlp_norm is not None
            return h + self.mlp(self.mlp_norm(h))
        mlp_in = normed if self.mlp_norm is None else self.mlp_norm(x)
        return x + (attended + self.mlp(mlp_in))
