"""The iserve engine against transformers on the same small checkpoints.

Checks full-prompt logits, decode-step logits (the KV-cache path) and the greedy token
sequence, for untied and tied embeddings, for a checkpoint transformers itself wrote, and
for Mistral's sliding-window attention.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from monitor_agent.engine.engine import Engine, SamplingConfig  # noqa: E402
from services.models.checkpoint import create_checkpoint  # noqa: E402

ATOL = 1e-5
PROMPT = "The model reads the prompt, predicts the next token, and repeats."
SMALL = {"hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2}


def _load_hf(directory: Path, cls_name: str = "LlamaForCausalLM") -> torch.nn.Module:
    cls = getattr(transformers, cls_name)
    # transformers 5 renamed torch_dtype to dtype.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = cls.from_pretrained(str(directory), **{key: torch.float32})
    return model.eval()


@pytest.fixture(scope="module", params=["untied", "tied"])
def pair(request, tmp_path_factory) -> tuple[Engine, torch.nn.Module]:
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    create_checkpoint(directory, **SMALL, tie_word_embeddings=request.param == "tied", seed=7)
    return Engine(directory, max_seq_len=128), _load_hf(directory)


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def _iserve_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        positions = torch.arange(len(ids)).unsqueeze(0)
        return engine.model(torch.tensor([ids]), positions, torch.tensor([0]))[0]


def test_prompt_logits_match(pair) -> None:
    engine, hf = pair
    ids = engine.encode(PROMPT)
    torch.testing.assert_close(_iserve_logits(engine, ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_decode_step_logits_match(pair) -> None:
    """Prefill part of the prompt, then feed the rest one token at a time via the cache."""
    engine, hf = pair
    ids = engine.encode(PROMPT)
    expected = _hf_logits(hf, ids)
    split = 5
    _iserve_logits(engine, ids[:split])
    with torch.inference_mode():
        for position in range(split, len(ids)):
            step = engine.model(
                torch.tensor([[ids[position]]]), torch.tensor([[position]]), torch.tensor([0])
            )
            torch.testing.assert_close(step[0, 0], expected[position], atol=ATOL, rtol=0)


def test_greedy_tokens_match_hf_generate(pair) -> None:
    engine, hf = pair
    ids = engine.encode(PROMPT)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    hf_tokens = out[0, len(ids) :].tolist()
    ours = [step.token_id for step in engine.generate(ids, 20, SamplingConfig())]
    assert ours == hf_tokens
    assert len(ours) == 20 or ours[-1] in engine.eos_token_ids


def test_greedy_tokens_match_without_eos(pair) -> None:
    """20 tokens exactly, even where the model would emit EOS."""
    engine, hf = pair
    ids = engine.encode("Once upon a time")
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False
        )
    hf_tokens = out[0, len(ids) :].tolist()
    ours = [s.token_id for s in engine.generate(ids, 20, SamplingConfig(ignore_eos=True))]
    # min_new_tokens masks EOS out in HF; ignore_eos lets iserve emit it, so compare only
    # up to the first EOS iserve produced.
    first_eos = next((i for i, t in enumerate(ours) if t in engine.eos_token_ids), len(ours))
    assert ours[:first_eos] == hf_tokens[:first_eos]
    assert len(ours) == 20


def test_checkpoint_saved_by_transformers_loads(tmp_path: Path) -> None:
    """A config and weights written by transformers' own save_pretrained."""
    source = create_checkpoint(tmp_path / "source", **SMALL, seed=3)
    hf = _load_hf(source)
    saved = tmp_path / "saved"
    hf.save_pretrained(str(saved))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, saved / name)
    engine = Engine(saved, max_seq_len=64)
    ids = engine.encode(PROMPT)
    torch.testing.assert_close(_iserve_logits(engine, ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_mistral_sliding_window_matches(tmp_path: Path) -> None:
    directory = create_checkpoint(tmp_path / "mistral", arch="mistral", sliding_window=4, **SMALL)
    engine, hf = Engine(directory, max_seq_len=64), _load_hf(directory, "MistralForCausalLM")
    ids = engine.encode(PROMPT)
    assert len(ids) > 8
    _assert_prompt_and_steps_match(engine, _hf_logits(hf, ids), ids)


def test_a_mistral_whose_layer_types_are_all_full_is_served_without_a_window(
    tmp_path: Path,
) -> None:
    """transformers' AutoModel reads a Mistral config with layer_types as Ministral's,
    each layer with the attention the list names (MistralForCausalLM itself warns that
    it ignores it): every layer attends in full. The engine windowed every layer, and
    its tokens differed from transformers'."""
    import json

    directory = create_checkpoint(tmp_path / "mistral", arch="mistral", sliding_window=4, **SMALL)
    config = json.loads((directory / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    # Ministral's config, which AutoModel reads it as, has no default head_dim.
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    (directory / "config.json").write_text(json.dumps(config))
    engine, hf = Engine(directory, max_seq_len=64), _load_hf(directory, "AutoModelForCausalLM")
    assert engine.spec.sliding_window is None
    ids = engine.encode(PROMPT)
    assert len(ids) > 8
    _assert_prompt_and_steps_match(engine, _hf_logits(hf, ids), ids)


def _assert_prompt_and_steps_match(
    engine: Engine, expected: torch.Tensor, ids: list[int], cached: int = 3
) -> None:
    """The prompt's logits, then each token after the first ``cached`` fed one at a time
    through the KV cache, equal ``expected`` (transformers' logits of ``ids``)."""
    torch.testing.assert_close(_iserve_logits(engine, ids), expected, atol=ATOL, rtol=0)
    _iserve_logits(engine, ids[:cached])
    with torch.inference_mode():
        for position in range(cached, len(ids)):
            step = engine.model(
                torch.tensor([[ids[position]]]), torch.tensor([[position]]), torch.tensor([0])
            )
            torch.testing.assert_close(step[0, 0], expected[position], atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches(tmp_path: Path) -> None:
    """Llama 3.1's stretched RoPE, in a checkpoint transformers wrote: the prompt's logits
    and every cached decode step equal transformers', and they are not those of the same
    weights with plain RoPE (so the scaling is what is being compared)."""
    import json

    from tests.parity.transformers_checkpoints import write_checkpoint

    directory = write_checkpoint(tmp_path / "llama31", "llama-3.1-style", seed=11)
    engine, hf = Engine(directory, max_seq_len=64), _load_hf(directory)
    assert engine.spec.rope_scaling is not None and engine.spec.rope_scaling.kind == "llama3"
    ids = engine.encode(PROMPT)
    assert len(ids) > 8  # beyond the 8 pretrained positions
    expected = _hf_logits(hf, ids)
    _assert_prompt_and_steps_match(engine, expected, ids)

    plain = tmp_path / "plain"
    shutil.copytree(directory, plain)
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(config))
    unscaled = _iserve_logits(Engine(plain, max_seq_len=64), ids)
    assert (unscaled - expected).abs().max() > 100 * ATOL
