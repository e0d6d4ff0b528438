"""Exact shapes of well-known models, as their published ``config.json`` files give them.

Each preset holds the fields of the model's published config that decide its shape and
layer structure (sizes, heads, KV heads, vocabulary, positions, rotary base, norms, tied
embeddings, biases), so ``services.models.families.parse_config`` reads it exactly as it would read the
real checkpoint. :func:`create_preset_checkpoint` writes a checkpoint of that shape with
random weights, optionally with fewer layers (a fingerprint-sized model with the real
widths), streaming tensor by tensor so even the full models need only megabytes of memory.

The written checkpoint carries iserve's small test tokenizer, so its BOS/EOS ids are the
tokenizer's (0 and 1, well inside every preset's vocabulary) instead of the published
ones; the vocabulary size, and with it the embedding's shape, stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.models.arch import ArchSpec
from services.models.checkpoint import write_checkpoint
from services.models.config_fields import DTYPE_BYTES
from services.models.families import config_with_layers, parse_config
from services.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # the Hugging Face repository the config comes from
    config: Mapping[str, Any]
    # Other repositories of the same model, e.g. the name it was first published under.
    aliases: tuple[str, ...] = ()

    @property
    def spec(self) -> ArchSpec:
        return parse_config(self.config)


def _gated(architecture: str, shape: tuple[int, int, int, int, int]) -> dict:
    """The fields a Llama-layout config (gated SiLU MLP, RMS norm, rotary positions,
    grouped-query attention) shares: (hidden, intermediate, layers, heads, KV heads)."""
    hidden, intermediate, layers, heads, kv_heads = shape
    return {
        "architectures": [f"{architecture}ForCausalLM"],
        "model_type": architecture.lower(),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def _llama2(*shape: int) -> dict:
    return {
        **_gated("Llama", shape),
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "pretraining_tp": 1,
        "torch_dtype": "float16",
        "vocab_size": 32000,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _llama3(*shape: int) -> dict:
    return {
        **_gated("Llama", shape),
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


def _llama31(*shape: int) -> dict:
    """Llama 3.1: Llama 3's shapes, its rotary frequencies stretched to 128K positions."""
    return {
        **_llama3(*shape),
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


def _qwen2(*shape: int) -> dict:
    return {
        **_gated("Qwen2", shape),
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": 131072,
        "max_window_layers": shape[2],
        "torch_dtype": "bfloat16",
        "vocab_size": 152064,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    }


_PRESETS = [
    Preset("llama-2-7b", "meta-llama/Llama-2-7b-hf", _llama2(4096, 11008, 32, 32, 32)),
    Preset("llama-2-13b", "meta-llama/Llama-2-13b-hf", _llama2(5120, 13824, 40, 40, 40)),
    Preset("llama-2-70b", "meta-llama/Llama-2-70b-hf", _llama2(8192, 28672, 80, 64, 8)),
    Preset(
        "codellama-34b",
        "codellama/CodeLlama-34b-hf",
        {
            **_llama2(8192, 22016, 48, 64, 8),
            "max_position_embeddings": 16384,
            "rope_theta": 1000000.0,
            "torch_dtype": "bfloat16",
        },
    ),
    Preset("llama-3-8b", "meta-llama/Meta-Llama-3-8B", _llama3(4096, 14336, 32, 32, 8)),
    Preset("llama-3-70b", "meta-llama/Meta-Llama-3-70B", _llama3(8192, 28672, 80, 64, 8)),
    # Llama 3.1 came out as meta-llama/Meta-Llama-3.1-*, renamed since.
    Preset(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B",
        _llama31(4096, 14336, 32, 32, 8),
        ("meta-llama/Meta-Llama-3.1-8B",),
    ),
    Preset(
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-70B",
        _llama31(8192, 28672, 80, 64, 8),
        ("meta-llama/Meta-Llama-3.1-70B",),
    ),
    Preset(
        "mistral-7b",
        "mistralai/Mistral-7B-v0.1",
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 32000,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    Preset("qwen2-7b", "Qwen/Qwen2-7B", _qwen2(3584, 18944, 28, 28, 4)),
    Preset("qwen2-72b", "Qwen/Qwen2-72B", _qwen2(8192, 29568, 80, 64, 8)),
    # Qwen2.5: Qwen2's layout; the 7B and 72B keep Qwen2's shapes, the 14B and 32B are new.
    Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B", _qwen2(3584, 18944, 28, 28, 4)),
    Preset(
        "qwen2.5-14b", "Qwen/Qwen2.5-14B", {**_qwen2(5120, 13824, 48, 40, 8), "rms_norm_eps": 1e-5}
    ),
    Preset(
        "qwen2.5-32b", "Qwen/Qwen2.5-32B", {**_qwen2(5120, 27648, 64, 40, 8), "rms_norm_eps": 1e-5}
    ),
    Preset(
        "qwen2.5-72b", "Qwen/Qwen2.5-72B", {**_qwen2(8192, 29568, 80, 64, 8), "rms_norm_eps": 1e-5}
    ),
    Preset(
        "falcon-7b",
        "tiiuae/falcon-7b",
        # The published Falcon configs leave tie_word_embeddings and max_position_embeddings
        # to FalconConfig's defaults (tied, 2048); both presets spell them out.
        {
            "architectures": ["FalconForCausalLM"],
            "model_type": "falcon",
            "hidden_size": 4544,
            "num_hidden_layers": 32,
            "num_attention_heads": 71,
            "new_decoder_architecture": False,
            "multi_query": True,
            "parallel_attn": True,
            "alibi": False,
            "bias": False,
            "layer_norm_epsilon": 1e-5,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "vocab_size": 65024,
            "bos_token_id": 11,
            "eos_token_id": 11,
        },
    ),
    Preset(
        "falcon-40b",
        "tiiuae/falcon-40b",
        {
            "architectures": ["FalconForCausalLM"],
            "model_type": "falcon",
            "hidden_size": 8192,
            "num_hidden_layers": 60,
            "num_attention_heads": 128,
            "num_kv_heads": 8,
            "new_decoder_architecture": True,
            "parallel_attn": True,
            "alibi": False,
            "bias": False,
            "layer_norm_epsilon": 1e-5,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "vocab_size": 65024,
            "bos_token_id": 11,
            "eos_token_id": 11,
        },
    ),
    Preset(
        "gpt-j-6b",
        "EleutherAI/gpt-j-6b",
        {
            "architectures": ["GPTJForCausalLM"],
            "model_type": "gptj",
            "n_embd": 4096,
            "n_layer": 28,
            "n_head": 16,
            "n_inner": None,
            "n_positions": 2048,
            "rotary_dim": 64,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "vocab_size": 50400,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
        },
    ),
]
PRESETS: dict[str, Preset] = {preset.name: preset for preset in _PRESETS}


def _spellings(preset: Preset) -> set[str]:
    names = {preset.name}
    for source in (preset.source, *preset.aliases):
        repository = source.lower()
        base = repository.rsplit("/", 1)[-1]
        names |= {repository, base, base.removesuffix("-hf")}
    return names


# Every way a preset is commonly written, lower case: its name, its Hugging Face
# repository ("meta-llama/Llama-2-70b-hf"), that repository's base name, and the base
# name without the "-hf" suffix of converted Llama checkpoints.
_BY_SPELLING: dict[str, str] = {
    spelling: preset.name for preset in _PRESETS for spelling in _spellings(preset)
}


def find_preset(name: str) -> str | None:
    """The preset a model name denotes, in any case: a preset's name or its Hugging Face
    repository, whole or its base name (``Llama-2-70b-hf``); None when none does."""
    return _BY_SPELLING.get(name.strip().lower())


def get_preset(name: str) -> Preset:
    """The named preset; KeyError lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(
            f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None


def preset_config(
    name: str, *, num_layers: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The preset's config, with ``num_layers`` decoder layers (default: all of them) and
    ``dtype`` (default: the published one)."""
    config = dict(get_preset(name).config)
    if num_layers is not None:
        config = config_with_layers(config, num_layers)
    if dtype is not None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        config["torch_dtype"] = dtype
    return config


def create_preset_checkpoint(
    out_dir: str | Path,
    name: str,
    *,
    num_layers: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight checkpoint with the preset's exact shapes; return its directory.

    ``num_layers`` keeps only that many decoder layers (every other tensor keeps its real
    shape). BOS/EOS become the test tokenizer's ids. Weights are streamed, so memory use
    does not grow with the model (see services.models.random_weights).
    """
    config = preset_config(name, num_layers=num_layers, dtype=dtype)
    config.update(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    return write_checkpoint(
        out_dir,
        config,
        seed=seed,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        progress=progress,
    )
