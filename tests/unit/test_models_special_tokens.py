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


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_tokenizer_saved_with_padding_and_truncation_encodes_as_transformers_does(
    tmp_path, tokenizer_json, auto_tokenizer, model_type
) -> None:
    """transformers leaves the padding and truncation of the last batch it encoded set
    on its backend, and save_pretrained writes them into tokenizer.json. AutoTokenizer
    turns both off for a call that asks for neither; iserve padded a prompt to 40 ids
    and cut it at 8."""
    raw = Tokenizer.from_str(tokenizer_json)
    raw.enable_padding(pad_id=EOS_ID, pad_token=EOS, length=40)
    raw.enable_truncation(max_length=8)
    tokenizer = write_tokenizer_files(
        tmp_path / "ckpt", raw.to_str(), model_type=model_type, post_processor="bos"
    )
    assert_encodes_like_transformers(tmp_path / "ckpt", tokenizer, auto_tokenizer)
    assert len(encode_prompt(tokenizer, TEXTS[0])) > 8


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


_CORPUS = [
    "The river runs past the old mill, and under the stone bridge.",
    "supercalifragilistic words, numbers 12345 and punctuation!?",
    "東京は日本の首都です。川は古い水車小屋のそばを流れる。",
    "naïve café — déjà vu, ﬁne ligatures ½ and e\u0301 marks",
    "    indented(code) == [1, 2, 3]  # comment\n\tnext_line()",
]


@functools.cache
def _prefix_tokenizers() -> dict[str, Tokenizer]:
    """One tokenizer of each model kind, trained here, with the pre-tokenizers and
    normalizers real checkpoints use around them."""
    from tokenizers import normalizers

    built: dict[str, Tokenizer] = {"byte-level-bpe": _bound_tokenizer()}
    metaspace = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    metaspace.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
    metaspace.train_from_iterator(_CORPUS * 8, trainer=trainer)
    metaspace.add_tokens([f"<0x{byte:02X}>" for byte in range(256)])
    built["metaspace-bpe"] = metaspace
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[CLS]"], show_progress=False
    )
    wordpiece.train_from_iterator(_CORPUS * 8, trainer=trainer)
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", wordpiece.token_to_id("[CLS]"))]
    )
    built["wordpiece"] = wordpiece
    unigram = Tokenizer(models.Unigram())
    unigram.normalizer = normalizers.NFKC()
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False
    )
    unigram.train_from_iterator(_CORPUS * 8, trainer=trainer)
    built["unigram"] = unigram
    return built


# Characters of the corpus, and runs a cut may fall inside: words, spaces, repeats.
_PROMPT_TEXT = st.lists(
    st.sampled_from(
        [*"".join(_CORPUS), "\U0001f600", "\u200b", "  ", "aaaa", " river", "東京", "\n\n"]
    ),
    min_size=1,
    max_size=300,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(
    text=_PROMPT_TEXT,
    kind=st.sampled_from(["byte-level-bpe", "metaspace-bpe", "wordpiece", "unigram"]),
)
def test_a_long_text_within_its_limit_is_never_refused_on_a_prefix(text, kind):
    """The encoder reads a long text by prefixes and refuses it once a prefix has more
    tokens than the limit allows for a cut: a text with exactly ``limit`` tokens is
    never refused, whatever its prefixes encode to, with each kind of tokenizer model.
    (Prefixes are forced here from the first character per token of the limit.)"""
    from unittest import mock

    from services.models import special_tokens

    tokenizer = _prefix_tokenizers()[kind]
    expected = encode_prompt(tokenizer, text)
    encoder = special_tokens.PromptEncoder(tokenizer, max_seq_len=4096)
    with mock.patch.object(special_tokens, "_WHOLE_CHARS_PER_TOKEN", 1):
        assert encoder(text, max_tokens=len(expected)) == expected


def test_a_huge_prompt_is_refused_after_reading_a_prefix_only():
    """Half a megabyte of text, within the bound on characters alone, is refused after
    its first few thousand characters: encoding it all took 0.7 s in which the worker's
    other prompts waited (a tester's +1-4 s on other clients' first tokens)."""
    import time

    from services.models.special_tokens import PromptEncoder, PromptTooLong

    tokenizer = _prefix_tokenizers()["metaspace-bpe"]
    encoder = PromptEncoder(tokenizer, max_seq_len=1024)
    for text in ("東京は日本の首都です。" * 40_000, "the river runs past the mill " * 15_000):
        assert len(text) > 400_000
        started = time.perf_counter()
        with pytest.raises(PromptTooLong) as refused:
            encoder(text, max_tokens=1000)
        took = time.perf_counter() - started
        assert 0 < refused.value.chars_read <= 8 * 1000 * 16, refused.value.chars_read
        assert refused.value.counted > 1000 and refused.value.limit == 1000
        assert "more than 1000 tokens" in str(refused.value)
        whole = time.perf_counter()
        encode_prompt(tokenizer, text)
        # Reading a prefix is a small part of reading it all (no timing bound: these
        # machines are noisy; the characters read above are the measure).
        assert took < time.perf_counter() - whole + 1.0


def test_a_long_text_of_long_pieces_within_the_limit_gets_its_exact_ids():
    """A text of more characters a token than the encoder reads whole (a word the
    vocabulary has as one piece) is read by prefixes, then whole: its ids are exactly
    those of encoding it at once."""
    from services.models.special_tokens import PromptEncoder

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([" supercalifragilisticexpialidocious"] * 50, trainer=trainer)
    text = " supercalifragilisticexpialidocious" * 100
    expected = encode_prompt(tokenizer, text)
    assert len(text) > 8 * len(expected)
    assert PromptEncoder(tokenizer, max_seq_len=4096)(text, max_tokens=len(expected)) == expected


def test_a_text_holding_an_added_token_past_the_vocabulary_is_refused_naming_it():
    """Registration accepts a tokenizer that adds tokens past config.json's vocab_size, as
    transformers does; a prompt text holding one is refused naming the token (the engine's
    own check named only "prompt_token_ids", which the client never sent)."""
    from services.models.special_tokens import PromptEncoder

    tokenizer = _bound_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.add_special_tokens(["<|tool|>"])
    assert tokenizer.token_to_id("<|tool|>") == vocab_size
    encoder = PromptEncoder(tokenizer, max_seq_len=256, vocab_size=vocab_size)
    assert max(encoder("the river runs past the mill")) < vocab_size
    with pytest.raises(ValueError, match=rf"'<\|tool\|>' \({vocab_size}\).* {vocab_size} ids"):
        encoder("call <|tool|> now")
    # Without a vocabulary to hold it to, the ids are the tokenizer's.
    assert vocab_size in PromptEncoder(tokenizer, max_seq_len=256)("call <|tool|> now")


def test_the_engine_refuses_a_text_holding_an_added_token_past_the_vocabulary(tmp_path):
    from services.models.tokenizer import build_tokenizer

    directory = create_checkpoint(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.add_special_tokens(["<|tool|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    engine = Engine(directory, max_seq_len=64)
    assert engine.spec.vocab_size == vocab_size
    with pytest.raises(ValueError, match=r"'<\|tool\|>'.*leave them out of the prompt"):
        engine.encode("call <|tool|> now")
    assert engine.encode("call the tool now")
