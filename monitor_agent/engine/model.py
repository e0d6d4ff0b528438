"""One decoder-only transformer for every family, parameterised by an ArchSpec.

The module tree is canonical, whatever the checkpoint calls things: ``embed_tokens``,
``layers.{j}.attn_norm`` / ``self_attn.{q,k,v,o}_proj`` / ``mlp_norm`` /
``mlp.{gate,up,down}_proj``, ``norm``, ``lm_head``. The loader maps checkpoint tensors
onto it (``ArchSpec.stage_weights``), splitting Falcon's fused ``query_key_value`` into
q/k/v. Norms are RMSNorm or LayerNorm, the MLP gated (SwiGLU) or plain (GELU), the
residual sequential or parallel, rotary full or partial, rotate-half or interleaved, all
as the spec says; attention runs over a static KV cache.

Contract for transforms (tensor parallelism, pipeline stages, quantization, pruning) —
they are applied to this model, never forks of it:

* Every attention module (``layers.{j}.self_attn``) holds ``n_heads``, ``n_kv_heads`` and
  ``head_dim`` as instance attributes and reads only those in forward; ``setup_caches``
  sizes each layer's KV cache from its attention's ``n_kv_heads`` and ``head_dim``. A
  tensor-parallel shard keeps a slice of the heads by shrinking the q/k/v rows, the
  o_proj columns and these attributes (call ``setup_caches`` afterwards).
* Every weight of attention and MLP is an ``nn.Linear`` submodule (``q_proj``, ``k_proj``,
  ``v_proj``, ``o_proj``; ``gate_proj`` (None when not gated), ``up_proj``,
  ``down_proj``), so quantization can swap Linear modules for its own, and structured
  pruning can shrink the MLP's inner width (rows of gate/up, columns of down) or heads.
  ``setup_caches`` then fuses each attention's q/k/v into one weight whose views the
  three Linears keep (``Attention.fuse_projections``), so every transform comes before
  it, or calls it again. The loader stores float32 Linear weights input-major
  (``loader.store_input_major``); a transform reads them as ordinary [out, in] tensors.
* Attention and MLP outputs pass through ``self.reduce(x)``, identity by default;
  tensor parallelism replaces it per module (``module.reduce = all_reduce``). A
  row-parallel ``o_proj``/``down_proj`` with a bias must keep that bias on one rank only.
* Pipeline stages: ``Transformer(spec, first_layer=f, layer_count=n)`` holds only layers
  ``[f, f + n)`` (``layers[j]`` is global layer ``f + j``). ``has_embedding`` (f == 0) and
  ``has_head`` (the stage ends at the last layer) say whether it holds ``embed_tokens``
  and ``norm`` + ``lm_head``; the others are None. forward takes token ids on a stage with
  the embedding and hidden states [B, T, hidden] otherwise, and returns logits on the
  last stage and hidden states otherwise. A tied LM head on a last stage that lacks the
  embedding is an ``lm_head`` of its own, loaded from the embedding tensor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from monitor_agent.engine.kv_cache import CacheAddress, LayerKVCache
from monitor_agent.engine.layer_clock import LayerClock, clocked_layers
from monitor_agent.engine.layers import CAUSAL, DecoderLayer, Mask, make_norm
from monitor_agent.engine.rope import rope_tables
from services.models.arch import ArchSpec


def _clock_now(x: torch.Tensor) -> float:
    """perf_counter once the device has finished the work queued for ``x``."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


class Transformer(nn.Module):
    """Decoder (or one pipeline stage of it) with a static KV cache; call
    :meth:`setup_caches` once before forward."""

    def __init__(
        self,
        spec: ArchSpec,
        dtype: torch.dtype = torch.float32,
        *,
        first_layer: int = 0,
        layer_count: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.first_layer, self.layer_count = spec.check_stage(first_layer, layer_count)
        self.has_embedding = self.first_layer == 0
        self.has_head = self.first_layer + self.layer_count == spec.num_layers
        hidden, vocab = spec.hidden_size, spec.vocab_size
        # Given its weight, nn.Embedding skips its random initialisation, which on the meta
        # device goes through torch._refs and imports torch._dynamo (over a second of a
        # worker's start-up on a small machine); the loader fills the weight in anyway.
        self.embed_tokens = (
            nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden, dtype=dtype))
            if self.has_embedding
            else None
        )
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype) for _ in range(self.layer_count))
        # Set by Engine(time_layers=True) (profiling workers); None costs nothing.
        self.layer_clock: LayerClock | None = None
        # Profiling workers of a fingerprint: copies of ``layers`` that forwards run on in
        # turn, so that the layers are timed with the full model's cache footprint
        # (monitor_agent.engine.footprint); empty: ``layers`` alone.
        self.layer_sets: tuple[nn.ModuleList, ...] = ()
        self._forwards = 0
        self.norm = make_norm(spec, dtype) if self.has_head else None
        # A tied head reuses the embedding when this stage has it (see forward).
        own_head = self.has_head and not (spec.tie_word_embeddings and self.has_embedding)
        self.lm_head = (
            nn.Linear(hidden, vocab, bias=spec.lm_head_bias, dtype=dtype) if own_head else None
        )
        self.max_batch = 0
        self.max_seq_len = 0

    def setup_caches(self, max_batch: int, max_seq_len: int) -> None:
        """Allocate the KV cache for max_batch slots of max_seq_len tokens and RoPE tables,
        and fuse each attention's q/k/v projections (``Attention.fuse_projections``)."""
        # Norm weights are in the activation dtype even when a transform quantizes Linears.
        norm_weight = self.layers[0].attn_norm.weight
        dtype, device = norm_weight.dtype, norm_weight.device
        for layer in self.layers:
            attn = layer.self_attn
            attn.fuse_projections()
            attn.kv_cache = LayerKVCache(
                max_batch, attn.n_kv_heads, max_seq_len, attn.head_dim, dtype, device
            )
        spec = self.spec
        cos, sin = rope_tables(
            spec.rotary_dim,
            max_seq_len,
            spec.rope_theta,
            dtype,
            device,
            interleaved=spec.rotary_interleaved,
            scaling=spec.rope_scaling,
        )
        # cos and sin side by side, so that a forward gathers both with one lookup.
        self.register_buffer("rope_table", torch.cat((cos, sin), dim=-1), persistent=False)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    def use_layer_sets(self, copies: Sequence[nn.ModuleList]) -> None:
        """Run forwards on ``layers`` and each of ``copies`` in turn (none: the layers
        alone); copies made after :meth:`setup_caches` share its KV caches
        (``monitor_agent.engine.footprint.copy_weights``)."""
        self.layer_sets = (self.layers, *copies) if copies else ()

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        *,
        last_token_only: bool = False,
    ) -> torch.Tensor:
        """Run this stage's layers over one step of a batch.

        ``inputs`` are token ids [B, T] on a stage with the embedding, else the previous
        stage's hidden states [B, T, hidden]. positions [B, T] are each token's absolute
        position in its sequence; slots [B] the cache slot of each row. Every position
        before a row's tokens must already be cached. Returns logits [B, T, vocab] (or
        [B, 1, vocab] with last_token_only) on the last stage, hidden states otherwise.
        """
        address = CacheAddress(slots, positions)
        rope = torch.embedding(self.rope_table, positions).unsqueeze(1)  # [B, 1, T, 2 · rot]
        cos, sin = rope.chunk(2, dim=-1)
        mask = self._attention_mask(positions, address.kv_len)
        batch, seq = positions.shape
        # The layers work on [B·T, hidden] (see layers.py).
        if self.embed_tokens is not None:
            x = self.embed_tokens.forward(inputs.reshape(batch * seq))
        else:
            x = inputs.reshape(batch * seq, -1)
        layers = self.layers
        if self.layer_sets:
            layers = self.layer_sets[self._forwards % len(self.layer_sets)]
            self._forwards += 1
        clock = self.layer_clock
        if clock is None:
            for layer in layers:
                x = layer.forward(x, cos, sin, address, mask)
        else:
            timed = clocked_layers(len(layers))
            for i, layer in enumerate(layers):
                if i == len(layers) - timed:
                    started = _clock_now(x)
                x = layer.forward(x, cos, sin, address, mask)
            clock.add(seq > 1, _clock_now(x) - started, timed)
        if self.norm is None:
            return x.view(batch, seq, -1)
        if last_token_only:
            x, seq = x.view(batch, seq, -1)[:, -1], 1
        x = self.norm.forward(x)
        if self.lm_head is None:
            assert self.embed_tokens is not None
            logits = F.linear(x, self.embed_tokens.weight)
        else:
            logits = self.lm_head.forward(x)
        return logits.view(batch, seq, -1)

    def _attention_mask(self, positions: torch.Tensor, kv_len: int) -> Mask:
        """Boolean [B, 1, T, kv_len] mask, True where a query may attend to a key.

        None when one token attends to everything cached so far (the common decode step);
        CAUSAL when every row holds positions 0 … T-1 and attends to those alone (a
        prefill from an empty cache, of one prompt or of prompts of one length).
        """
        window = self.spec.sliding_window
        batch, seq = positions.shape
        if batch == 1 and seq == 1 and (window is None or kv_len <= window):
            return None
        if (
            seq == kv_len
            and (window is None or seq <= window)
            and bool((positions == torch.arange(seq, device=positions.device)).all())
        ):
            return CAUSAL
        key_positions = torch.arange(kv_len, device=positions.device)
        query_positions = positions[:, :, None]
        allowed = key_positions <= query_positions
        if window is not None:
            allowed &= key_positions > query_positions - window
        return allowed.unsqueeze(1)
