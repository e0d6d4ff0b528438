"""Registration refuses tokenizer files the worker or the gateway would fail on later:
a tokenizer.json the tokenizers library cannot load, token ids beyond the model's
vocab_size, a chat template that does not compile."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fingerprint_svc.registry import build_model
from services.api import model_service_pb2 as model_pb
from services.errors import InvalidArgument
from services.models.checkpoint import (
    InvalidCheckpoint,
    build_tokenizer,
    create_checkpoint,
    validate_checkpoint,
)
from services.models.special_tokens import encode_prompt
from services.models.tokenizer import VOCAB_SIZE

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return create_checkpoint(tmp_path_factory.mktemp("ref") / "ckpt", **SMALL)


@pytest.fixture
def checkpoint(reference: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(reference, tmp_path / "ckpt"))


def register(directory: Path) -> model_pb.Model:
    request = model_pb.RegisterModelRequest(model_id="m", checkpoint_path=directory.name)
    return build_model(request, directory.parent)


def shrink_vocabulary(directory: Path, vocab_size: int) -> None:
    """Config and weights of a model whose vocabulary is ``vocab_size`` rows."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = np.ascontiguousarray(tensors[name][:vocab_size])
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))


def test_a_vocab_size_below_the_tokenizers_is_refused_naming_both(checkpoint: Path) -> None:
    shrink_vocabulary(checkpoint, 200)
    with pytest.raises(InvalidArgument, match=f"ids up to {VOCAB_SIZE - 1}.*vocab_size is 200"):
        register(checkpoint)


def test_an_added_token_beyond_the_vocab_size_is_accepted(checkpoint: Path) -> None:
    # A <pad> appended after a full vocabulary (some Llama-2 fine-tunes): transformers
    # loads it, and only a prompt holding that token lacks an embedding row.
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(["<|tool|>"])
    assert tokenizer.token_to_id("<|tool|>") == VOCAB_SIZE
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    assert validate_checkpoint(checkpoint).spec.vocab_size == VOCAB_SIZE


def test_a_vocab_size_padded_beyond_the_tokenizers_is_accepted(tmp_path: Path) -> None:
    padded = create_checkpoint(tmp_path / "padded", **SMALL, vocab_size=VOCAB_SIZE + 128)
    assert register(padded).shape.vocab_size == VOCAB_SIZE + 128


@pytest.mark.parametrize(
    "content",
    ['{"version": "1.0", "model": 42}', '{"version": "1.0"}', "[]"],
)
def test_a_tokenizer_json_the_library_cannot_load_is_refused(checkpoint: Path, content) -> None:
    (checkpoint / "tokenizer.json").write_text(content)
    with pytest.raises(InvalidArgument, match="tokenizer.json in .* is not a tokenizer"):
        register(checkpoint)


def _word_level(vocabulary: list[str], unknown: str | None) -> str:
    """A word-level tokenizer.json over ``vocabulary`` whose unknown-word token is
    ``unknown`` (which the vocabulary may lack)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(vocabulary)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


def test_a_tokenizer_json_that_loads_but_cannot_encode_text_is_refused(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").write_text(_word_level(["a"], "zzz"))
    with pytest.raises(InvalidArgument, match=r"loads but cannot encode the text.*Missing \[UNK\]"):
        register(checkpoint)


def test_a_prompt_the_tokenizer_cannot_encode_is_a_value_error() -> None:
    """The worker turns it into INVALID_ARGUMENT, not an internal error."""
    from tokenizers import Tokenizer

    from services.models.tokenizer_files import SAMPLE_TEXT

    words = ["Hello", ",", "world", ".", "42"]
    tokenizer = Tokenizer.from_str(_word_level(words, None))
    assert encode_prompt(tokenizer, SAMPLE_TEXT) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="tokenizer cannot encode this prompt"):
        encode_prompt(tokenizer, "zebra")


@pytest.mark.parametrize("content", ['{"tokenizer_class": "Llama', "not json{", "[1, 2]"])
def test_a_tokenizer_config_that_is_not_a_json_object_is_refused(checkpoint: Path, content) -> None:
    (checkpoint / "tokenizer_config.json").write_text(content)
    with pytest.raises(InvalidArgument, match="tokenizer_config.json in .* is not"):
        register(checkpoint)


def test_a_checkpoint_without_a_tokenizer_config_is_accepted(checkpoint: Path) -> None:
    (checkpoint / "tokenizer_config.json").unlink()
    assert register(checkpoint)


BROKEN = "{% for m in messages %}{{ m['content'] }{% endfor %}"


def test_a_chat_template_that_does_not_compile_is_refused(checkpoint: Path) -> None:
    (checkpoint / "chat_template.jinja").write_text(BROKEN)
    with pytest.raises(InvalidArgument, match=r"chat_template.jinja does not compile.*'\}'"):
        register(checkpoint)
    (checkpoint / "chat_template.jinja").unlink()
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config["chat_template"] = "ok\n" + BROKEN
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidCheckpoint, match=r"tokenizer_config.json does not compile.*line 2"):
        validate_checkpoint(checkpoint)


@pytest.mark.parametrize(
    "template", ["{% include '/etc/passwd' %}", "{% import 'os' as os %}", "{% extends 'x' %}"]
)
def test_a_chat_template_loading_another_is_refused(checkpoint: Path, template: str) -> None:
    # No loader: it fails on every conversation, once answered as the request's fault.
    (checkpoint / "chat_template.jinja").write_text(template)
    with pytest.raises(InvalidArgument, match="does not compile: the template loads another"):
        register(checkpoint)


def test_templates_that_compile_or_are_absent_are_accepted(tmp_path: Path) -> None:
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    plain = create_checkpoint(tmp_path / "plain", **SMALL, chat_template=None)
    refusing = create_checkpoint(tmp_path / "refusing", **SMALL, chat_template=strict)
    assert register(plain) and register(refusing)


def test_the_loader_skips_the_tokenizer_checks(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").write_text("{}")
    assert validate_checkpoint(checkpoint, require_tokenizer=False).spec.num_layers == 2


# ---- Llama-2-style SentencePiece tokenizers, run as transformers runs them ------------
# A tokenizer.json as transformers 4 wrote Llama 2's: byte-fallback BPE under a
# Prepend("▁") + Replace(" ", "▁") normalizer, BOS added by the post-processor.
SPM_SPECIALS = ("<unk>", "<s>", "</s>")
SPM_LINES = (
    "The river runs past the old mill, and under the stone bridge.\n",
    "Once upon a time there was a small town by the sea.\n",
    "  indented   with   runs of spaces\tand tabs\n",
)


@pytest.fixture(scope="module")
def spm_tokenizer_json() -> str:
    return llama_2_style_tokenizer_json()


def llama_2_style_tokenizer_json() -> str:
    """The tokenizer.json text (see SPM_SPECIALS' comment)."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPM_SPECIALS), show_progress=False
    )
    tokenizer.train_from_iterator(SPM_LINES * 8, trainer=trainer)
    spec = json.loads(tokenizer.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    order = [*SPM_SPECIALS, *byte_tokens]
    order += [t for t, _ in learned if t not in order]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    for added in spec["added_tokens"]:
        added["id"] = order.index(added["content"])
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }  # fmt: skip
    return json.dumps(spec)


def _beside_transformers(tmp_path, tokenizer_json: str, model_type: str, tokenizer_config):
    """(iserve's tokenizer, transformers' AutoTokenizer) of a checkpoint directory holding
    ``tokenizer_json``, a config of ``model_type`` and ``tokenizer_config``."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from services.models.tokenizer_files import load_tokenizer

    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(tokenizer_json)
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    return load_tokenizer(directory, model_type), reference


def _spm_texts() -> list[str]:
    """Fixed prompts (leading and repeated spaces, special tokens inside the text, as a
    rendered Llama 2 chat prompt has them, non-ASCII) and random ones from a seeded
    generator over the pieces where the pipelines could differ."""
    import random

    fixed = [
        "  two spaces",
        " lead",
        "a  b   c",
        "<s>[INST] hi [/INST]",
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST] ok </s><s>[INST] more [/INST]",
        "\u2581already marked",
        "caf\u00e9 \u4e2d\u6587 \U0001f600",
        "\n\nnew lines",
        "",
    ]
    pieces = [
        " ",
        "  ",
        "\u2581",
        "<s>",
        "</s>",
        "\n",
        "the",
        "river",
        "\u00e9",
        "\u4e2d",
        "x",
        "[INST]",
    ]
    rng = random.Random(7)
    return fixed + ["".join(rng.choices(pieces, k=rng.randint(1, 12))) for _ in range(60)]


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
@pytest.mark.parametrize(
    "tokenizer_class",
    [None, "LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "PreTrainedTokenizerFast"],
)
@pytest.mark.parametrize("legacy", [None, True, False])
@pytest.mark.parametrize("add_prefix_space", [None, False])
def test_a_sentencepiece_style_tokenizer_encodes_and_decodes_as_transformers_runs_it(
    tmp_path, spm_tokenizer_json, model_type, tokenizer_class, legacy, add_prefix_space
) -> None:
    """transformers 5 rebuilds a llama model's LlamaTokenizer / CodeLlamaTokenizer with
    the class's own pipeline (services.models.tokenizer_files.as_transformers_runs_it);
    iserve encoded with the file's normalizer, a "▁" more after each special token."""
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    optional = {
        "tokenizer_class": tokenizer_class,
        "legacy": legacy,
        "add_prefix_space": add_prefix_space,
    }
    tokenizer_config |= {k: v for k, v in optional.items() if v is not None}
    tokenizer, reference = _beside_transformers(
        tmp_path, spm_tokenizer_json, model_type, tokenizer_config
    )
    for text in _spm_texts():
        for special in (True, False):  # a chat prompt is encoded without (it holds them)
            ids = encode_prompt(tokenizer, text, add_special_tokens=special)
            assert ids == reference(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = encode_prompt(tokenizer, text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        ), text


# ---- byte-level BPE files that transformers' own classes rebuild ----------------------
@pytest.fixture(scope="module")
def byte_level_tokenizer_json() -> str:
    """A byte-level BPE trained by the tokenizers library itself, no normalizer: what a
    user wraps in PreTrainedTokenizerFast and saves beside a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [
        "Hello world, the café is open. café 你好世界",
        "tab\tnew\nline x: a\nb 42 numbers 1234 don't we'll",
    ] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer.to_str()


BYTE_LEVEL_TEXTS = [
    "Hello world",
    "été café",  # decomposed accents: NFC composes them
    "你好世界，今天",
    "tab\tnew\nline",
    "x: a\nb",
    "  two  spaces",
    "don't 1234",
    "<|endoftext|>after",
]


@pytest.mark.parametrize(
    ("model_type", "tokenizer_config"),
    [
        # transformers 5 runs a qwen2 model's tokenizer as Qwen2Tokenizer whatever class is
        # named (NFC, Qwen's split, add_prefix_space from the config).
        ("qwen2", {"tokenizer_class": "TokenizersBackend"}),
        ("qwen2", {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": True}),
        ("qwen2", {}),
        # A gptj model's is GPT2Tokenizer unless another class is named.
        ("gptj", {}),
        ("gptj", {"add_prefix_space": True}),
        # Any model whose config names GPT2Tokenizer or Qwen2Tokenizer.
        ("llama", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}),
        ("llama", {"tokenizer_class": "Qwen2TokenizerFast"}),
        ("falcon", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}),
        ("qwen2", {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": True}),
        # The file as written: another class named, or a mistral model whatever is named.
        ("falcon", {"tokenizer_class": "PreTrainedTokenizerFast"}),
        ("gptj", {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": True}),
        ("mistral", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}),
        ("llama", {"tokenizer_class": "TokenizersBackend"}),
    ],
)
def test_a_byte_level_tokenizer_encodes_as_auto_tokenizer_runs_it(
    tmp_path, byte_level_tokenizer_json, model_type, tokenizer_config
) -> None:
    """A probe found prompts of such checkpoints encoded from the file as written where
    AutoTokenizer rebuilds it: 14 ids for 7 (no NFC), a prefix space missing, every chat
    prompt different. iserve runs them as transformers' class does."""
    tokenizer, reference = _beside_transformers(
        tmp_path,
        byte_level_tokenizer_json,
        model_type,
        {"eos_token": "<|endoftext|>", **tokenizer_config},
    )
    for text in BYTE_LEVEL_TEXTS:
        for special in (True, False):
            ids = encode_prompt(tokenizer, text, add_special_tokens=special)
            assert ids == reference(text, add_special_tokens=special)["input_ids"], (text, special)
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        ), text
