"""Prompt encoding equals transformers' AutoTokenizer's; special ids outside the vocabulary
are dropped with a warning, and such a checkpoint registers and serves.

Each case writes the tokenizer files a checkpoint may have (``tokenizer.json`` with or
without a post-processor, ``tokenizer_config.json``, ``special_tokens_map.json``) next to
a ``config.json`` naming the family, and compares ``encode_prompt`` with
``AutoTokenizer.from_pretrained(directory)(text)["input_ids"]``.

The texts are plain prose on purpose. For qwen2 transformers rebuilds the tokenizer with
Qwen2Tokenizer's own pre-tokenizer instead of the file's, which cuts digits one by one;
that is how text is split, not which special tokens are added, and is not covered here.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from monitor_agent.engine.engine import Engine, SamplingConfig
from services.models.checkpoint import (
    InvalidCheckpoint,
    build_tokenizer,
    create_checkpoint,
    validate_checkpoint,
)
from services.models.special_tokens import (
    encode_prompt,
    generation_eos_ids,
    max_prompt_chars,
    stop_eos_ids,
)
from services.models.tokenizer_files import load_tokenizer

FAMILIES = ("llama", "mistral", "qwen2", "falcon", "gptj")
TEXTS = (
    "The river runs past the old mill, and under the stone bridge.",
    "Once upon a time there was a small town",
    "",
)
BOS, EOS = "<s>", "</s>"
# The trainer puts special tokens first.
BOS_ID, EOS_ID = 0, 1
VOCAB_SIZE = 300

# tokenizer.json post-processors: what each adds to a single sequence.
POST_PROCESSORS: dict[str, Any] = {
    "none": None,
    "bos": processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    ),
    "eos": processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, EOS_ID)]
    ),
    "roberta": processors.RobertaProcessing((EOS, EOS_ID), (BOS, BOS_ID)),
    "bytelevel-then-bos": processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)]),
        ]
    ),
}


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer, trained here on a few lines, with no post-processor."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 4, trainer=trainer)
    assert (tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)) == (BOS_ID, EOS_ID)
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def auto_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer


def write_tokenizer_files(
    directory: Path,
    tokenizer_json: str,
    *,
    model_type: str,
    post_processor: str,
    tokenizer_config: dict[str, Any] | None = None,
    special_tokens_map: dict[str, Any] | None = None,
) -> Tokenizer:
    """Write config.json and the tokenizer files; return the tokenizer iserve loads."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.post_processor = POST_PROCESSORS[post_processor]
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"model_type": model_type, "vocab_size": VOCAB_SIZE, "bos_token_id": BOS_ID}
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS_ID}))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if special_tokens_map is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return load_tokenizer(directory, model_type)


def assert_encodes_like_transformers(directory: Path, tokenizer: Tokenizer, auto: Any) -> None:
    reference = auto.from_pretrained(str(directory))
    for text in TEXTS:
        assert encode_prompt(tokenizer, text) == reference(text)["input_ids"], text


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize(
    "tokenizer_config",
    [None, {"add_bos_token": True}, {"add_bos_token": False}, {"add_eos_token": True}],
    ids=["no-tokenizer-config", "add-bos", "no-bos", "add-eos"],
)
@pytest.mark.parametrize("post_processor", ["none", "bos"])
def test_prompt_encoding_matches_transformers(
    tmp_path, tokenizer_json, auto_tokenizer, model_type, tokenizer_config, post_processor
) -> None:
    tokenizer = write_tokenizer_files(
        tmp_path / "ckpt",
        tokenizer_json,
        model_type=model_type,
        post_processor=post_processor,
        tokenizer_config=tokenizer_config,
    )
    assert_encodes_like_transformers(tmp_path / "ckpt", tokenizer, auto_tokenizer)
    # The post-processor alone decides; tokenizer_config.json's add_*_token flags do not.
    starts_with_bos = encode_prompt(tokenizer, TEXTS[0])[0] == BOS_ID
    assert starts_with_bos == (post_processor == "bos")


@pytest.mark.parametrize(
    ("model_type", "post_processor", "tokenizer_config", "special_tokens_map"),
    [
        ("llama", "eos", None, None),
        ("gptj", "roberta", None, None),
        ("qwen2", "bytelevel-then-bos", None, None),
        ("llama", "none", {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True}, None),
        ("llama", "bos", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False}, None),
        ("falcon", "none", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS}, None),
        ("gptj", "none", {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True}, None),
        ("mistral", "none", {"bos_token": BOS, "add_bos_token": True}, None),
        ("mistral", "none", None, {"bos_token": BOS, "eos_token": EOS}),
    ],
)
def test_other_special_token_sources_match_transformers(
    tmp_path,
    tokenizer_json,
    auto_tokenizer,
    model_type,
    post_processor,
    tokenizer_config,
    special_tokens_map,
) -> None:
    tokenizer = write_tokenizer_files(
        tmp_path / "ckpt",
        tokenizer_json,
        model_type=model_type,
        post_processor=post_processor,
        tokenizer_config=tokenizer_config,
        special_tokens_map=special_tokens_map,
    )
    assert_encodes_like_transformers(tmp_path / "ckpt", tokenizer, auto_tokenizer)


def test_engine_encodes_like_transformers(tmp_path, auto_tokenizer) -> None:
    """A checkpoint with no tokenizer_config.json and a tokenizer.json that adds no BOS:
    the engine's prompt starts with no BOS, though config.json names one."""
    directory = create_checkpoint(
        tmp_path / "ckpt", arch="llama", seed=1, hidden_size=64, num_layers=1, num_heads=4
    )
    (directory / "tokenizer_config.json").unlink()
    tokenizer = build_tokenizer()
    tokenizer.post_processor = None
    tokenizer.save(str(directory / "tokenizer.json"))
    engine = Engine(directory, max_seq_len=64)
    reference = auto_tokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        assert engine.encode(text) == reference(text)["input_ids"]
    assert engine.encode(TEXTS[0])[0] != engine.spec.bos_token_id


def test_engine_runs_a_llama_2_style_tokenizer_as_transformers_does(
    tmp_path, auto_tokenizer
) -> None:
    """A llama checkpoint whose tokenizer_config.json names LlamaTokenizerFast over a
    transformers-4-style SentencePiece tokenizer.json: the engine encodes a chat prompt
    (special tokens inside the text) as AutoTokenizer does, without a "▁" after <s>."""
    from tests.unit.test_models_tokenizer_files import llama_2_style_tokenizer_json

    directory = create_checkpoint(
        tmp_path / "ckpt", arch="llama", seed=1, hidden_size=64, num_layers=1, num_heads=4
    )
    (directory / "tokenizer.json").write_text(llama_2_style_tokenizer_json())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine(directory, max_seq_len=128)
    reference = auto_tokenizer.from_pretrained(str(directory))
    chat = "<s>[INST] hi there [/INST]"
    assert (
        engine.encode(chat, add_special_tokens=False)
        == reference(chat, add_special_tokens=False)["input_ids"]
    )
    assert engine.encode("  two spaces") == reference("  two spaces")["input_ids"]


def test_gptj_with_special_ids_outside_the_vocabulary_registers_and_serves(
    tmp_path, caplog
) -> None:
    """Like Hugging Face's GPT-J config on a small vocabulary: BOS and EOS 50256."""
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        directory = create_checkpoint(
            tmp_path / "gptj",
            arch="gptj",
            seed=2,
            hidden_size=64,
            num_layers=1,
            num_heads=4,
            config_overrides={"bos_token_id": 50256, "eos_token_id": 50256},
        )
        spec = validate_checkpoint(directory).spec
    assert (spec.bos_token_id, spec.eos_token_ids) == (None, ())
    assert "config bos_token_id 50256 is outside the vocabulary" in caplog.text
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 50256]}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        engine = Engine(directory, max_seq_len=64)
    assert engine.eos_token_ids == frozenset({1})
    assert "generation_config.json eos_token_id 50256 is outside the vocabulary" in caplog.text
    outputs = list(engine.generate(engine.encode(TEXTS[0]), 4, SamplingConfig(ignore_eos=True)))
    assert len(outputs) == 4
    assert all(0 <= step.token_id < spec.vocab_size for step in outputs)


def test_generation_config_eos_ids(tmp_path, caplog) -> None:
    assert generation_eos_ids(tmp_path, VOCAB_SIZE) is None
    assert stop_eos_ids([EOS_ID, 33], tmp_path, VOCAB_SIZE) == frozenset({EOS_ID, 33})
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [EOS_ID, 7, 50256, True, "x"]}))
    assert generation_eos_ids(tmp_path, VOCAB_SIZE) == frozenset({EOS_ID, 7})
    path.write_text(json.dumps({"eos_token_id": 5}))
    assert generation_eos_ids(tmp_path, VOCAB_SIZE) == frozenset({5})
    # As transformers' generate: generation_config.json's ids alone when it is read
    # (config.json's 33 is not a stop then; the union stopped on it), else config.json's.
    assert stop_eos_ids([EOS_ID, 33], tmp_path, VOCAB_SIZE) == frozenset({5})
    # A generation config naming no EOS stops on none, not on config.json's.
    for no_eos in ({"do_sample": True}, {"eos_token_id": None}):
        path.write_text(json.dumps(no_eos))
        assert generation_eos_ids(tmp_path, VOCAB_SIZE) == frozenset()
        assert stop_eos_ids([EOS_ID, 33], tmp_path, VOCAB_SIZE) == frozenset()
    # One transformers cannot parse it ignores, building the generation config from config.json.
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="iserve.models"):
        assert stop_eos_ids([EOS_ID, 33], tmp_path, VOCAB_SIZE) == frozenset({EOS_ID, 33})
    assert "generation_config.json is not valid JSON" in caplog.text
    path.write_text("[1, 2]")
    with pytest.raises(InvalidCheckpoint, match="generation_config.json is malformed"):
        generation_eos_ids(tmp_path, VOCAB_SIZE)


# generation_config.json as written, or None for none; config.json names EOS ids 1 and 33.
GENERATION_CONFIGS: dict[str, str | None] = {
    "absent": None,
    "an id": json.dumps({"eos_token_id": 5}),
    "a list": json.dumps({"eos_token_id": [1, 7]}),
    "null": json.dumps({"eos_token_id": None, "do_sample": False}),
    "no key": json.dumps({"bos_token_id": 0, "do_sample": False}),
    "not JSON": "{not json",
}


@pytest.mark.parametrize("case", GENERATION_CONFIGS)
def test_the_engine_stops_on_the_eos_ids_transformers_generates_with(tmp_path, case) -> None:
    transformers = pytest.importorskip("transformers")
    directory = create_checkpoint(tmp_path / "ckpt", hidden_size=32, num_layers=1, num_heads=4)
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = [1, 33]
    (directory / "config.json").write_text(json.dumps(config))
    generation = GENERATION_CONFIGS[case]
    if generation is None:
        (directory / "generation_config.json").unlink()
    else:
        (directory / "generation_config.json").write_text(generation)
    eos = transformers.AutoModelForCausalLM.from_pretrained(
        directory
    ).generation_config.eos_token_id
    expected = frozenset() if eos is None else frozenset(eos if isinstance(eos, list) else [eos])
    assert Engine(directory, max_seq_len=64).eos_token_ids == expected


def test_a_generation_config_without_eos_runs_to_the_token_limit(tmp_path) -> None:
    """config.json's EOS is the first token the model emits; generation_config.json names
    none, so transformers' generate does not stop on it, and neither does the engine."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    directory = create_checkpoint(tmp_path / "ckpt", hidden_size=32, num_layers=1, num_heads=4)
    prompt = [0, 17, 42, 99]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.inference_mode():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = first
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6)[0, len(prompt) :]
    engine = Engine(directory, max_seq_len=64)
    served = [step.token_id for step in engine.generate(prompt, 6, SamplingConfig())]
    assert served == expected.tolist()
    assert len(served) == 6 and served[0] == first


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_no_text_is_longer_than_the_bound_for_its_own_token_count(text):
    """max_prompt_chars(tokenizer, n) bounds the length of every text that encodes to n
    tokens, so a worker may refuse a longer one without encoding it."""
    tokenizer = _bound_tokenizer()
    n = len(tokenizer.encode(text, add_special_tokens=False).ids)
    assert len(text) <= max_prompt_chars(tokenizer, max(n, 1))


@functools.cache
def _bound_tokenizer():
    from services.models.tokenizer import build_tokenizer

    return build_tokenizer()


def test_encoding_lets_the_other_threads_of_a_worker_run(tmp_path) -> None:
    """A prompt is encoded without the GIL: the thread that steps and streams the other
    sequences goes on meanwhile (tokenizers' ``encode`` holds it: a half-megabyte prompt
    froze every stream of a worker for a second)."""
    import threading
    import time

    directory = create_checkpoint(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    tokenizer = load_tokenizer(directory, "llama")
    text = "the quick brown fox jumps over the lazy dog " * 12_000
    done = threading.Event()
    ticks = 0

    def count() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.0005)

    counter = threading.Thread(target=count)
    counter.start()
    started = time.perf_counter()
    ids = encode_prompt(tokenizer, text)
    took = time.perf_counter() - started
    done.set()
    counter.join()
    assert ids == tokenizer.encode(text).ids
    # Holding the GIL, the encoding lets the counter tick once per switch interval
    # (5 ms) at most; without it the counter ticks about every 0.5 ms.
    assert ticks > 3 * took / 0.005 + 5, (ticks, took)
