"""The building blocks of the decoder: norms, attention, MLP and one decoder layer.

Every block reads its shape from the ArchSpec once, in its constructor, and from its own
attributes afterwards, so transforms (tensor-parallel sharding, structured pruning,
quantization) can change a block in place; see model.py for the contract they rely on.
Activations are [B·T, hidden]: a 2-D input lets each Linear go straight to one matrix
product, without matmul's folding of a 3-D batch (≈ 2 % of a small model's decode step);
attention takes B and T from the cache address.

Blocks call their submodules' ``forward`` directly rather than through
``nn.Module.__call__``: its hook dispatch costs about a microsecond a call, some 15 calls
per layer and token, which a small model's decode step feels (≈ 6 % of the forward of
bench/engine_vs_transformers.py's tiny model). Hooks registered on these submodules are
therefore not run; nothing in iserve registers any.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from monitor_agent.engine.kv_cache import CacheAddress, LayerKVCache
from monitor_agent.engine.rope import apply_rope
from services.models.arch import ArchSpec

# The mask of a pass whose every row holds a sequence's first tokens from position 0 and
# attends to exactly those (a prefill from an empty cache): causal, which attention
# applies without a [T, T] mask. Built, such a mask costs T² bytes and, as
# scaled_dot_product_attention turns it into floats on CPU, 4 T² more: 1.3 GiB of a
# 16k-token prefill of any model, which no reservation counted.
CAUSAL = "causal"
Mask = torch.Tensor | str | None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        if x.dtype == torch.float32:
            # RMSNorm through LayerNorm's fused one-pass CPU kernel: [x, -x] has mean 0 and
            # variance mean(x²), so LayerNorm of it starts with x / √(mean(x²) + ε).
            # torch.rms_norm dispatches ~8 elementwise and reduction ops instead; this is
            # ≈ 8 % of the tiny benchmark model's decode step, and differs from it by
            # ~2 ulp (the mean of [x, -x] is 0 only up to rounding).
            doubled = torch.cat((x, x.neg()), dim=-1)
            normed = torch.layer_norm(doubled, (2 * width,), None, None, self.eps)
            return normed.narrow(-1, 0, width) * self.weight
        # Normalise in float32 and scale in the model dtype, as Hugging Face Llama does.
        normed = torch.rms_norm(x.float(), (width,), eps=self.eps)
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
        # Set by fuse_projections: q, k and v rows of one weight, multiplied at once.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Store q_proj, k_proj and v_proj as one [q + k + v, in] weight (and bias): forward
        then projects with one matmul and rotates q and k with one RoPE call (≈ 6 % of the
        tiny benchmark model's decode forward). The three Linears keep their weights as
        views of it, so no memory is added.

        Fuses only three plain ``nn.Linear`` (a quantized or sparse projection keeps its
        own module) of one dtype, device and bias-ness; the fused weight keeps their layout
        (input-major, see ``loader.store_input_major``, when all three are). A transform
        that replaces or shrinks q/k/v afterwards must call this again
        (``Transformer.setup_caches`` does).
        """
        self.qkv_weight = self.qkv_bias = None
        linears = (self.q_proj, self.k_proj, self.v_proj)
        if any(type(linear) is not nn.Linear for linear in linears):
            return
        weights = [linear.weight for linear in linears]
        biases = [linear.bias for linear in linears]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            return
        has_bias = [b is not None for b in biases]
        if any(has_bias) and not all(has_bias):
            return
        if all(w.stride(0) == 1 for w in weights):  # input-major
            fused = torch.cat([w.t() for w in weights], dim=1).t()
        else:
            fused = torch.cat(weights)
        fused_bias = torch.cat(biases) if all(has_bias) else None
        start = 0
        for linear in linears:
            stop = start + linear.out_features
            linear.weight = nn.Parameter(fused[start:stop], linear.weight.requires_grad)
            if fused_bias is not None:
                linear.bias = nn.Parameter(fused_bias[start:stop], linear.bias.requires_grad)
            start = stop
        self.qkv_weight, self.qkv_bias = fused, fused_bias

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Combine partial outputs across tensor-parallel ranks; identity on one rank."""
        return x

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        address: CacheAddress,
        mask: Mask,
    ) -> torch.Tensor:
        batch, seq = address.positions.shape
        heads, kv_heads, head_dim = self.n_heads, self.n_kv_heads, self.head_dim
        interleaved = self.rotary_interleaved
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
            qkv = qkv.view(batch, seq, heads + 2 * kv_heads, head_dim).transpose(1, 2)
            qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin, interleaved=interleaved)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        else:
            q = self.q_proj.forward(x).view(batch, seq, heads, head_dim).transpose(1, 2)
            k = self.k_proj.forward(x).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
            v = self.v_proj.forward(x).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
            q = apply_rope(q, cos, sin, interleaved=interleaved)
            k = apply_rope(k, cos, sin, interleaved=interleaved)
        assert self.kv_cache is not None, "call Transformer.setup_caches before forward"
        keys, values = self.kv_cache.update(address, k, v)
        causal = isinstance(mask, str)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=None if causal else mask,
            is_causal=causal,
            enable_gqa=kv_heads != heads,
        )
        out = out.transpose(1, 2).reshape(batch * seq, heads * head_dim)
        return self.reduce(self.o_proj.forward(out))


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
            inner = self.act(self.up_proj.forward(x))
        else:
            # The product in place of the activation's output (a fresh tensor): a prefill
            # holds two [tokens, inner] tensors at once, not three.
            inner = self.act(self.gate_proj.forward(x))
            inner.mul_(self.up_proj.forward(x))
        return self.reduce(self.down_proj.forward(inner))


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
        mask: Mask,
    ) -> torch.Tensor:
        normed = self.attn_norm.forward(x)
        attended = self.self_attn.forward(normed, cos, sin, address, mask)
        if not self.parallel_residual:
            h = x + attended
            assert self.mlp_norm is not None
            return h + self.mlp.forward(self.mlp_norm.forward(h))
        mlp_in = normed if self.mlp_norm is None else self.mlp_norm.forward(x)
        return x + (attended + self.mlp.forward(mlp_in))
