"""One decoder-only transformer, parameterised by an ArchSpec (Llama/Mistral layout).

Module and parameter names follow the Hugging Face checkpoint names
(``model.layers.0.self_attn.q_proj.weight`` …), so loading is a name-for-name copy.
RMSNorm, rotary embeddings (rotate_half), SwiGLU MLP and grouped-query attention over a
static KV cache; tied or untied LM head. Sharding, pipeline slicing and quantization are
meant to be transforms applied to this model, not forks of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from monitor_agent.engine.kv_cache import CacheAddress, LayerKVCache
from monitor_agent.engine.rope import apply_rope, rope_tables
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


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, head_dim = spec.hidden_size, spec.head_dim
        bias = spec.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            head_dim,
        )
        self.q_proj = nn.Linear(hidden, spec.num_heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, spec.num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, spec.num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(spec.num_heads * head_dim, hidden, bias=bias, dtype=dtype)
        self.kv_cache: LayerKVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        address: CacheAddress,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        assert self.kv_cache is not None, "call Transformer.setup_caches before forward"
        keys, values = self.kv_cache.update(address, k, v)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = SwiGLU(spec, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        address: CacheAddress,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, address, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Everything under the ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


class Transformer(nn.Module):
    """Decoder with a static KV cache; call :meth:`setup_caches` once before forward."""

    def __init__(self, spec: ArchSpec, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec, dtype)
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        )
        self.max_batch = 0
        self.max_seq_len = 0

    def setup_caches(self, max_batch: int, max_seq_len: int) -> None:
        """Allocate the KV cache for max_batch slots of max_seq_len tokens and RoPE tables."""
        weight = self.model.embed_tokens.weight
        dtype, device = weight.dtype, weight.device
        spec = self.spec
        for layer in self.model.layers:
            layer.self_attn.kv_cache = LayerKVCache(
                max_batch, spec.num_kv_heads, max_seq_len, spec.head_dim, dtype, device
            )
        cos, sin = rope_tables(spec.head_dim, max_seq_len, spec.rope_theta, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        *,
        last_token_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, 1, vocab] with last_token_only) for input_ids [B, T].

        positions [B, T] are each token's absolute position in its sequence; slots [B] the
        cache slot of each row. Every position before a row's tokens must already be cached.
        """
        address = CacheAddress(slots, positions)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        mask = self._attention_mask(positions, address.kv_len)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, address, mask)
        if last_token_only:
            x = x[:, -1:]
        x = self.model.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)

    def _attention_mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor | None:
        """Boolean [B, 1, T, kv_len] mask, True where a query may attend to a key.

        None when one token attends to everything cached so far (the common decode step).
        """
        window = self.spec.sliding_window
        batch, seq = positions.shape
        if batch == 1 and seq == 1 and (window is None or kv_len <= window):
            return None
        key_positions = torch.arange(kv_len, device=positions.device)
        query_positions = positions[:, :, None]
        allowed = key_positions <= query_positions
        if window is not None:
            allowed &= key_positions > query_positions - window
        return allowed.unsqueeze(1)
