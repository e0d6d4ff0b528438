"""Small checkpoints written by transformers itself, with awkward shapes.

Each family's model is built from transformers' own config and model classes, given
random weights large enough that greedy choices are not near-ties, and written with
``save_pretrained`` (config.json, generation_config.json, model.safetensors) as a user's
checkpoint would be. The tokenizer is a byte-level BPE trained in code on a few sentences
with the ``tokenizers`` library and written as ``tokenizer.json`` only, with no
``tokenizer_config.json``; one family's file also carries a post-processor that adds BOS.

Shapes (every family has 3 layers, so a pipeline splits them 1 + 2, and heads, KV heads
and MLP widths that split two ways):

========================  =====  ===========  ==========================================
family                    heads  KV heads     also
========================  =====  ===========  ==========================================
llama                     6      2 (GQA)      untied embeddings, BOS from the post-processor
llama-3.1-style           6      2            llama3 RoPE scaling (a context of 8 stretched)
mistral                   4      1 (MQA)      tied embeddings
qwen2                     6      2            qkv bias, tied embeddings
falcon (7B style)         6      1 (MQA)      parallel attention, old decoder layout
falcon (40B style)        6      2            new_decoder_architecture, two layer norms
gptj                      6      6            partial rotary (8 of 16 dims), biased LM head,
                                              BOS/EOS 50256 beyond a 320-token vocabulary
llama-tied-config         6      2            saved untied, config.json then edited to
                                              ``tie_word_embeddings: true``
falcon-tied-by-default    6      2            40B style saved untied, ``tie_word_embeddings``
                                              then removed (FalconConfig defaults to tied)
========================  =====  ===========  ==========================================

The last two are tied by their config over an LM head of values of its own, which
transformers keeps ("both are present in the checkpoints with different values, so we
will NOT tie them"): CONFIG_EDITS are applied to config.json after save_pretrained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 320  # the model's; the tokenizer's own is a little smaller
LAYERS = 3
CORPUS = [
    "The model reads the prompt, predicts the next token, and repeats.",
    "A river runs past the old mill and on towards the sea.",
    "Serving systems schedule requests, batch them and stream tokens back.",
    "Every layer of the decoder attends to the tokens before it.",
]

LLAMA = {
    "hidden_size": 96,
    "intermediate_size": 176,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
FALCON_40B_STYLE = {
    "hidden_size": 96,
    "num_attention_heads": 6,
    "num_kv_heads": 2,
    "new_decoder_architecture": True,
    "parallel_attn": True,
    "bias": False,
}

# name: (transformers config class, its fields, BOS added by the tokenizer file?)
FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama": ("LlamaConfig", LLAMA, True),
    # Llama 3.1's stretched RoPE, with a pretrained context of 8 positions so that the
    # prompt and its generation (~30 positions) run where every branch of it matters:
    # head_dim 16 has wavelengths of 6.3 (blended) and 20-6283 (stretched 4x) positions.
    "llama-3.1-style": (
        "LlamaConfig",
        {
            **LLAMA,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
        False,
    ),
    "mistral": (
        "MistralConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 144,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "sliding_window": None,
        },
        False,
    ),
    "qwen2": (
        "Qwen2Config",
        {
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
        False,
    ),
    "falcon-7b-style": (
        "FalconConfig",
        {
            "hidden_size": 96,
            "num_attention_heads": 6,
            "multi_query": True,
            "new_decoder_architecture": False,
            "parallel_attn": True,
            "bias": False,
        },
        False,
    ),
    "falcon-40b-style": ("FalconConfig", FALCON_40B_STYLE, False),
    "llama-tied-config": ("LlamaConfig", LLAMA, False),
    "falcon-tied-by-default": (
        "FalconConfig",
        {**FALCON_40B_STYLE, "tie_word_embeddings": False},
        False,
    ),
    "gptj": (
        "GPTJConfig",
        {"n_embd": 96, "n_head": 6, "rotary_dim": 8, "n_positions": 256},
        False,
    ),
}


# family: config.json fields replaced after saving (None: the field removed)
CONFIG_EDITS: dict[str, dict[str, Any]] = {
    "llama-tied-config": {"tie_word_embeddings": True},
    "falcon-tied-by-default": {"tie_word_embeddings": None},
}


def write_tokenizer(path: Path, *, add_bos: bool) -> None:
    """A byte-level BPE tokenizer.json with <s> (id 0) and </s> (id 1), adding <s> to
    every encoding when ``add_bos``."""
    bpe_tokenizer(add_bos=add_bos).save(str(path))


def bpe_tokenizer(*, add_bos: bool):
    """The byte-level BPE of :func:`write_tokenizer`, trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    return tokenizer


def write_checkpoint(directory: Path, family: str, seed: int) -> Path:
    """``family``'s checkpoint, written by transformers' save_pretrained into ``directory``."""
    import transformers

    config_class, fields, add_bos = FAMILIES[family]
    layers_key = "n_layer" if config_class == "GPTJConfig" else "num_hidden_layers"
    special = {} if config_class == "GPTJConfig" else {"bos_token_id": 0, "eos_token_id": 1}
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=256,
        **{layers_key: LAYERS},
        **special,
        **fields,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            # Norm weights near 1, everything else small but far from HF's near-zero
            # initialisation, so that greedy choices have clear margins.
            is_norm = "norm" in name or "ln_" in name
            if is_norm and name.endswith("weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            else:
                parameter.copy_(0.05 * noise)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    write_tokenizer(directory / "tokenizer.json", add_bos=add_bos)
    if family in CONFIG_EDITS:
        path = directory / "config.json"
        edited = {**json.loads(path.read_text()), **CONFIG_EDITS[family]}
        path.write_text(json.dumps({k: v for k, v in edited.items() if v is not None}))
    return directory
