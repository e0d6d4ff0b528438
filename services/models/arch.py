"""Shapes of decoder-only models, read from a Hugging Face ``config.json``.

An :class:`ArchSpec` is everything the control plane and the engine need to know about a
model's shape: sizes, layer structure, tensor names, parameter and KV-cache bytes. It is
built once from the checkpoint's config (written by transformers 4 or 5) and never
imports torch, so the fingerprint cutter, the estimator and the engine can all share it.

One spec describes every supported family with a handful of structural switches (norm
kind, gated or plain MLP, sequential or parallel residual, biases, partial or interleaved
rotary); the families themselves live in :mod:`services.models.families`, each turning a
config into a spec and naming the checkpoint tensors a spec implies.

Two views of the weights exist. :meth:`ArchSpec.expected_tensors` is the checkpoint's
view (Hugging Face names and shapes). :meth:`ArchSpec.stage_weights` is the engine's view:
for each parameter of the engine's canonical module tree (Llama-style names, fused
projections split into q/k/v) the checkpoint tensor and rows it is read from, restricted
to one pipeline stage's layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.models.config_fields import DTYPE_BYTES
from services.models.errors import InvalidConfig, UnsupportedArchitecture
from services.models.rope_scaling import RopeScaling

__all__ = [
    "ArchSpec",
    "CheckpointTensor",
    "InvalidConfig",
    "UnsupportedArchitecture",
    "CheckpointLayout",
    "WeightSource",
]

# Tensors that some exporters write but that carry no learned weights (recomputed at load).
HARMLESS_EXTRA_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)
NORM_KINDS = ("rms", "layer")
ACTIVATIONS = ("silu", "gelu", "gelu_new")

# Row ranges [start, stop) of a tensor's first dimension, concatenated in order.
RowRanges = tuple[tuple[int, int], ...]


class CheckpointLayout(Protocol):
    """What a family says about its checkpoints' tensor names (a ``families.Family``);
    ``parse_config`` puts it on each spec it parses, so this module needs no family."""

    embedding: str
    final_norm: str
    harmless_suffixes: tuple[str, ...]

    def layer_tensors(self, spec: ArchSpec, layer: int) -> list[CheckpointTensor]: ...


@dataclass(frozen=True)
class ArchSpec:
    """Shape of a decoder-only transformer; sizes are element counts unless named bytes.

    The defaults of the structural fields describe Llama; other families set them.
    """

    family: str  # "llama" | "mistral" | "qwen2" | "falcon" | "gptj"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    # The LM head is the token embedding: the config's flag, which validating the
    # checkpoint turns off over a head of other values (services.models.tied_head).
    tie_word_embeddings: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # "rms": RMSNorm (weight only); "layer": LayerNorm (weight and bias).
    norm_kind: str = "rms"
    # MLP activation: "silu", "gelu" (exact, erf) or "gelu_new" (tanh approximation).
    hidden_act: str = "silu"
    # down(act(gate(x)) * up(x)) when gated (SwiGLU); down(act(up(x))) otherwise.
    gated_mlp: bool = True
    # Parallel: x + attn(norm(x)) + mlp(norm'(x)); sequential: h = x + attn(norm(x)),
    # then h + mlp(norm'(h)).
    parallel_residual: bool = False
    # Parallel layers whose attention and MLP read one norm's output (Falcon-7B, GPT-J).
    shared_layer_norm: bool = False
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    lm_head_bias: bool = False
    # Leading dimensions of each head that rotate; 0 (the default) means all of them,
    # and is stored as head_dim.
    rotary_dim: int = 0
    # GPT-J rotates pairs (x0, x1), (x2, x3), …; the others pair x_i with x_{i+d/2}.
    rotary_interleaved: bool = False
    # Mistral-style local attention: a query sees at most this many keys (itself included).
    sliding_window: int | None = None
    # Rotary frequencies stretched for a longer context (Llama 3.1's "llama3", "linear").
    rope_scaling: RopeScaling | None = None
    # The family's checkpoint tensor names (set by families.parse_config; not compared).
    layout: CheckpointLayout | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm_kind must be one of {NORM_KINDS}, got {self.norm_kind!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.shared_layer_norm and not self.parallel_residual:
            raise ValueError("shared_layer_norm needs parallel_residual")
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(
                f"rotary_dim ({self.rotary_dim}) must be even and in (0, head_dim={self.head_dim}]"
            )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the checkpoint's declared dtype."""
        return DTYPE_BYTES[self.torch_dtype]

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by Hugging Face name, with its shape,
        in the order the checkpoint writer stores them."""
        return {t.name: t.shape for t in self.checkpoint_tensors()}

    def checkpoint_tensors(self) -> list[CheckpointTensor]:
        """The checkpoint's tensors in file order, each with the engine parameters it fills."""
        family = self._family()
        tensors = [
            CheckpointTensor(
                family.embedding,
                (self.vocab_size, self.hidden_size),
                (("embed_tokens.weight", None),),
            )
        ]
        for layer in range(self.num_layers):
            tensors.extend(family.layer_tensors(self, layer))
        return tensors + self._head_tensors(family)

    def stage_weights(
        self, first_layer: int = 0, layer_count: int | None = None
    ) -> dict[str, WeightSource]:
        """Where each engine parameter of one pipeline stage is read from.

        The stage holds layers ``[first_layer, first_layer + layer_count)`` (default: to
        the last layer), the token embedding only if it is the first stage and the final
        norm and LM head only if it is the last. Keys are the engine's parameter names:
        ``embed_tokens.weight``, ``layers.{j}.…`` with j counted from the stage's first
        layer, ``norm.weight``/``norm.bias``, ``lm_head.weight``/``lm_head.bias``. A tied
        LM head on a stage without the embedding is read from the embedding tensor.
        """
        first, count = self.check_stage(first_layer, layer_count)
        has_embedding, has_head = first == 0, first + count == self.num_layers
        weights: dict[str, WeightSource] = {}
        family = self._family()
        if has_embedding:
            weights["embed_tokens.weight"] = WeightSource(family.embedding)
        for j, layer in enumerate(range(first, first + count)):
            for tensor in family.layer_tensors(self, layer):
                for target, rows in tensor.targets:
                    weights[f"layers.{j}.{target}"] = WeightSource(tensor.name, rows)
        if has_head:
            for tensor in self._head_tensors(family):
                for target, rows in tensor.targets:
                    weights[target] = WeightSource(tensor.name, rows)
            if self.tie_word_embeddings and not has_embedding:
                weights["lm_head.weight"] = WeightSource(family.embedding)
        return weights

    def check_stage(self, first_layer: int, layer_count: int | None) -> tuple[int, int]:
        """(first_layer, layer_count) of a valid stage; ValueError names what is wrong."""
        if not 0 <= first_layer < self.num_layers:
            raise ValueError(f"first_layer must be in [0, {self.num_layers}), got {first_layer}")
        remaining = self.num_layers - first_layer
        count = remaining if layer_count is None else layer_count
        if not 1 <= count <= remaining:
            raise ValueError(
                f"layer_count must be in [1, {remaining}] for first_layer {first_layer} "
                f"of {self.num_layers} layers, got {layer_count}"
            )
        return first_layer, count

    @property
    def embedding_tensor(self) -> str:
        """The checkpoint name of the token embedding (the family's)."""
        return self._family().embedding

    def is_ignorable_tensor(self, name: str) -> bool:
        """Whether an extra checkpoint tensor is a buffer carrying nothing the engine
        needs: rotary ``inv_freq`` buffers, or attention-mask buffers old exporters saved.
        (An LM head beside a tied embedding is not: whether it is a mere copy depends on
        its values, see :mod:`services.models.tied_head`.)"""
        return name.endswith(HARMLESS_EXTRA_SUFFIXES + self._family().harmless_suffixes)

    def parameter_count(self) -> int:
        """Number of learned parameters (a tied LM head counted once)."""
        return sum(math.prod(shape) for shape in self.expected_tensors().values())

    def weight_bytes(self, dtype_bytes: int | None = None) -> int:
        """Bytes of all parameters at ``dtype_bytes`` per element (default: config dtype)."""
        return self.parameter_count() * (self.dtype_bytes if dtype_bytes is None else dtype_bytes)

    def kv_cache_bytes(
        self, max_seq_len: int, batch_size: int, dtype_bytes: int | None = None
    ) -> int:
        """Bytes of a static K and V cache for ``batch_size`` sequences of ``max_seq_len``."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        element_bytes = self.dtype_bytes if dtype_bytes is None else dtype_bytes
        return per_token * max_seq_len * batch_size * element_bytes

    def _family(self) -> CheckpointLayout:
        if self.layout is None:
            raise ValueError(
                "this ArchSpec was built directly, without its family's checkpoint layout; "
                "parse it with services.models.families.parse_config"
            )
        return self.layout

    def _head_tensors(self, family: CheckpointLayout) -> list[CheckpointTensor]:
        hidden = (self.hidden_size,)
        tensors = [
            CheckpointTensor(f"{family.final_norm}.weight", hidden, (("norm.weight", None),))
        ]
        if self.norm_kind == "layer":
            tensors.append(
                CheckpointTensor(f"{family.final_norm}.bias", hidden, (("norm.bias", None),))
            )
        if not self.tie_word_embeddings:
            tensors.append(
                CheckpointTensor(
                    "lm_head.weight",
                    (self.vocab_size, self.hidden_size),
                    (("lm_head.weight", None),),
                )
            )
        if self.lm_head_bias:
            tensors.append(
                CheckpointTensor("lm_head.bias", (self.vocab_size,), (("lm_head.bias", None),))
            )
        return tensors


@dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor and the engine parameters it fills.

    ``targets`` pairs each engine parameter name (relative to its decoder layer for layer
    tensors) with the rows of this tensor it takes (None: the whole tensor). A plain
    tensor has one target; Falcon's fused ``query_key_value`` has three.
    """

    name: str
    shape: tuple[int, ...]
    targets: tuple[tuple[str, RowRanges | None], ...]


@dataclass(frozen=True)
class WeightSource:
    """Where one engine parameter is read from: a checkpoint tensor, or some of its rows,
    and for a tensor-parallel shard of a row-parallel weight a range [start, stop) of its
    columns (the second dimension)."""

    tensor: str
    rows: RowRanges | None = None
    columns: tuple[int, int] | None = None


ParseConfig = Callable[[Mapping[str, Any], str], ArchSpec]
LayerTensors = Callable[[ArchSpec, int], list[CheckpointTensor]]


# What any checkpoint of a model (a compressed variant's own too) keeps of it: these
# fields equal, these at most the model's (structured pruning keeps fewer heads and MLP
# channels, never more).
SAME_FIELDS = ("family", "num_layers", "hidden_size", "head_dim", "vocab_size")
AT_MOST_FIELDS = ("num_heads", "num_kv_heads", "intermediate_size")


def unlike_model(spec: ArchSpec, model_field: Callable[[str], object]) -> str | None:
    """Why a checkpoint of shape ``spec`` cannot be one of the model whose value of each
    field ``model_field(name)`` gives (None: not known, not compared); None when it can."""
    for name in SAME_FIELDS:
        theirs = model_field(name)
        if theirs is not None and getattr(spec, name) != theirs:
            return f"its checkpoint has {name} {getattr(spec, name)}, the model has {theirs}"
    for name in AT_MOST_FIELDS:
        theirs = model_field(name)
        if theirs is not None and getattr(spec, name) > theirs:
            return (
                f"its checkpoint has {name} {getattr(spec, name)}, more than the model's {theirs}"
            )
    return None
