"""Shared checks of the iserve engine against transformers on one checkpoint.

Each family's parity file builds small checkpoints and runs the same three checks: the
logits of a whole prompt, the logits of decode steps through the KV cache, and 16 greedy
tokens against ``generate(do_sample=False)``. ``randomize_weights`` first replaces every
tensor (norm weights and biases included, which a fresh checkpoint holds at 1 and 0) so
that every tensor's mapping into the engine is exercised.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from monitor_agent.engine.engine import Engine, SamplingConfig
from services.models.checkpoint import validate_checkpoint

ATOL = 1e-5
PROMPT = "The model reads the prompt, predicts the next token, and repeats."
GREEDY_TOKENS = 16


@dataclass(frozen=True)
class ParityPair:
    """The same checkpoint loaded by iserve's engine and by transformers."""

    engine: Engine
    hf: torch.nn.Module
    directory: Path


def parity_pair(directory: Path, hf_class: str, seed: int) -> ParityPair:
    """Randomize the checkpoint's weights, then load it both ways."""
    randomize_weights(directory, seed)
    return ParityPair(Engine(directory, max_seq_len=128), load_hf(directory, hf_class), directory)


def randomize_weights(directory: Path, seed: int) -> None:
    """Give every tensor of a single-file checkpoint random values (norm weights near 1)."""
    spec = validate_checkpoint(directory).spec
    targets = {t.name: t.targets[0][0] for t in spec.checkpoint_tensors()}
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        base = 1.0 if targets[name].endswith("norm.weight") else 0.0
        scale = 0.2 if base else 0.05
        tensors[name] = (base + scale * noise).to(tensor.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def load_hf(directory: Path, cls_name: str) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, cls_name)
    # transformers 5 renamed torch_dtype to dtype.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return cls.from_pretrained(str(directory), **{key: torch.float32}).eval()


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def engine_logits(engine: Engine, ids: list[int], start: int = 0) -> torch.Tensor:
    """Logits of ids[start:] run as one step after ids[:start] are cached."""
    with torch.inference_mode():
        positions = torch.arange(start, len(ids)).unsqueeze(0)
        return engine.model(torch.tensor([ids[start:]]), positions, torch.tensor([0]))[0]


def max_prompt_logit_diff(pair: ParityPair, engine: Engine | None = None) -> float:
    """Assert the prompt's logits agree within ATOL; return the largest difference.

    ``engine`` replaces the pair's own (for a checkpoint re-saved by transformers)."""
    engine = engine or pair.engine
    ids = engine.encode(PROMPT)
    ours, theirs = engine_logits(engine, ids), hf_logits(pair.hf, ids)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    return float((ours - theirs).abs().max())


def check_decode_steps(pair: ParityPair, split: int = 5) -> None:
    """Prefill part of the prompt, then feed the rest one token at a time via the cache."""
    engine = pair.engine
    ids = engine.encode(PROMPT)
    expected = hf_logits(pair.hf, ids)
    engine_logits(engine, ids[:split])
    for position in range(split, len(ids)):
        step = engine_logits(engine, ids[: position + 1], start=position)
        torch.testing.assert_close(step[0], expected[position], atol=ATOL, rtol=0)


def check_greedy_generation(pair: ParityPair) -> None:
    """16 greedy tokens equal HF generate's (both stop early, EOS included, on EOS)."""
    engine = pair.engine
    ids = engine.encode(PROMPT)
    with torch.inference_mode():
        out = pair.hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
    hf_tokens = out[0, len(ids) :].tolist()
    ours = [step.token_id for step in engine.generate(ids, GREEDY_TOKENS, SamplingConfig())]
    assert ours == hf_tokens
    assert len(ours) == GREEDY_TOKENS or ours[-1] in engine.eos_token_ids


def check_transformers_save_loads(pair: ParityPair, out_dir: Path) -> None:
    """A config and weights written by transformers' own save_pretrained serve the same."""
    pair.hf.save_pretrained(str(out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pair.directory / name, out_dir / name)
    max_prompt_logit_diff(pair, Engine(out_dir, max_seq_len=64))
