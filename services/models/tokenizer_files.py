"""A checkpoint's tokenizer files, checked when it is registered.

A tokenizer the worker cannot load, ids the model has no embedding row for, or a chat
template that does not compile would otherwise pass registration and fail later, at
deploy or on every request, with an error that blames the wrong party. Each is refused
here, naming the file:

- ``tokenizer.json`` must load with the ``tokenizers`` library, as the worker loads it,
  and encode plain text (a word-level vocabulary whose unknown-word token is missing
  loads, then fails every prompt);
- ``tokenizer_config.json``, where there is one, must be a JSON object (transformers
  refuses the tokenizer otherwise, and its special tokens would be lost);
- the highest id of its model's vocabulary must be below the config's ``vocab_size``: a
  smaller one makes ordinary text fail. A larger ``vocab_size`` (rows padded to a round
  number) is fine, and so are added tokens beyond it (a ``<pad>`` appended at 32000 to a
  32000-row Llama-2, which transformers loads): only a prompt holding one is refused;
- a tokenizer whose class transformers 5 rebuilds (Llama, Code Llama, Qwen2, GPT-2) is
  run as it runs it (below);
- the chat template the gateway renders (:mod:`services.models.chat_template`) must
  compile in the same Jinja environment. A checkpoint without one is fine: its chat
  requests are refused with the reason, and completions work.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateSyntaxError
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers

from services.models.arch import ArchSpec
from services.models.chat_template import (
    MAX_TEMPLATE_FILE_BYTES,
    TOKENIZER_CONFIG,
    NoChatTemplate,
    UnreadableChatTemplate,
    compile_template,
    read_chat_template,
)
from services.models.checkpoint_files import read_checkpoint_text, read_json_object
from services.models.errors import InvalidCheckpoint

TOKENIZER_FILE = "tokenizer.json"
# Plain text any tokenizer that serves prompts must encode (one with an unknown-word
# token or byte fallback encodes anything; one without either fails on its first word).
SAMPLE_TEXT = "Hello, world. 42"
# The SentencePiece-style word marker that Metaspace writes for a space.
_METASPACE = "\u2581"


def load_tokenizer(directory: Path, family: str) -> Tokenizer:
    """The checkpoint's tokenizer as the engines and registration use it: its
    ``tokenizer.json``, run the way transformers' ``AutoTokenizer`` runs it for a model
    of ``family`` (its ``ArchSpec.family``, the config's model type; see
    :func:`as_transformers_runs_it`); InvalidCheckpoint naming the file when the
    ``tokenizers`` library cannot read it."""
    try:
        # Read here, not by the library: it takes the path as UTF-8 whatever the locale
        # says, and a checkpoint under a non-ASCII directory in a Latin-1 locale was
        # "not a tokenizer" (no such file).
        text = read_checkpoint_text(directory / TOKENIZER_FILE)
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidCheckpoint(
            f"{TOKENIZER_FILE} in {str(directory)!r} is not a tokenizer the tokenizers "
            f"library can load: {exc}"
        ) from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the library raises its own Exception for every problem
        raise InvalidCheckpoint(
            f"{TOKENIZER_FILE} in {str(directory)!r} is not a tokenizer the tokenizers "
            f"library can load: {exc}"
        ) from None
    as_transformers_runs_it(tokenizer, family, _json_object(directory / TOKENIZER_CONFIG))
    # A tokenizer.json may carry the padding and truncation of the last batch it encoded
    # before it was saved (transformers leaves them set on its backend, and
    # save_pretrained writes them). AutoTokenizer turns both off for a call that asks for
    # neither, as serving a prompt does: padded, a prompt became 40 ids of which 32 were
    # padding; truncated, it lost its end.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _json_object(path: Path) -> dict:
    """``path``'s JSON object, {} when there is no such file (tokenizer_config.json is
    optional); InvalidCheckpoint naming it when it is there but not one: transformers
    refuses such a tokenizer, and its special tokens and chat template would be lost."""
    if not path.exists():
        return {}
    # The gateway's bound on it (it reads the chat template there): a larger one
    # registered, and every chat was then refused.
    return read_json_object(path, MAX_TEMPLATE_FILE_BYTES)


def as_transformers_runs_it(tokenizer: Tokenizer, family: str, tokenizer_config: dict) -> None:
    """Give ``tokenizer`` the pipeline transformers 5's ``AutoTokenizer`` runs it with,
    where that differs from its ``tokenizer.json``.

    For a ``llama`` model whose ``tokenizer_config.json`` names ``LlamaTokenizer`` or
    ``CodeLlamaTokenizer`` (``Fast`` or not), transformers builds the tokenizer from
    that class's own code. Only the file's vocabulary, merges and post-processor are
    kept. There is no normalizer: Llama 2's ``Prepend("▁")`` + ``Replace(" ", "▁")``
    normalizer put a "▁" after every special token of a chat prompt. Instead a
    ``Metaspace(split=False)`` pre-tokenizer prepends "▁" only where the text does not
    start with one, as ``prepend_scheme`` says:

    - ``add_prefix_space`` false gives "never";
    - Llama with ``legacy`` true gives "always";
    - otherwise "first", only at the start of the prompt.

    The decoder is Replace, ByteFallback, Fuse, and then Strip of one leading space
    (Code Llama always; Llama with ``add_prefix_space``). The BPE model fuses unknown
    pieces and falls back to bytes. Checked against transformers itself by
    ``tests/unit/test_models_tokenizer_files.py``.

    A BPE ``tokenizer.json`` that transformers runs as ``Qwen2Tokenizer`` or
    ``GPT2Tokenizer`` (:func:`_byte_level_class`) gets that class's byte-level pipeline
    (:func:`_as_byte_level_class_runs_it`): a probe's Qwen2 checkpoint with a
    ``tokenizers``-trained file, no NFC, was encoded to 14 ids where transformers gives 7.

    Left as the file says: a byte-level ``tokenizer.json`` of a llama model (Llama 3's,
    whose hub config still names ``LlamaTokenizer``: transformers runs the file); a
    ``mistral`` model's whatever class is named; any other class.
    """
    named = str(tokenizer_config.get("tokenizer_class") or "").removesuffix("Fast")
    rebuilt_as = _byte_level_class(family, named)
    if rebuilt_as is not None:
        _as_byte_level_class_runs_it(tokenizer, rebuilt_as, tokenizer_config)
        return
    if family != "llama" or named not in ("LlamaTokenizer", "CodeLlamaTokenizer"):
        return
    spec = json.loads(tokenizer.to_str())
    if spec.get("model", {}).get("type") != "BPE" or _byte_level(spec):
        return
    code_llama = named == "CodeLlamaTokenizer"
    add_prefix_space = tokenizer_config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    if not add_prefix_space:
        scheme = "never"
    elif not code_llama and tokenizer_config.get("legacy", False):
        scheme = "always"
    else:
        scheme = "first"
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_METASPACE, prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace(_METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if code_llama or add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.model.fuse_unk = True
    tokenizer.model.byte_fallback = True
    tokenizer.model.dropout = None


# Qwen2Tokenizer's split of the text before byte-level BPE (transformers 5).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_level_class(family: str, named: str) -> str | None:
    """The byte-level BPE class transformers 5's ``AutoTokenizer`` builds a ``family``
    model's tokenizer with, ``named`` the ``tokenizer_config.json`` class (without
    ``Fast``), when that class rebuilds the pipeline around the file's vocabulary: a
    ``qwen2`` model's is ``Qwen2Tokenizer`` whatever class is named (transformers lists
    qwen2 among the types whose hub configs name a wrong class); a ``gptj`` model's
    ``GPT2Tokenizer`` unless another class is named; any other model's the named one of
    the two. A ``mistral`` model runs the file whatever is named. None: no such class."""
    if family == "qwen2":
        return "Qwen2Tokenizer"
    if family == "mistral":
        return None
    if family == "gptj" and not named:
        return "GPT2Tokenizer"
    return named if named in ("Qwen2Tokenizer", "GPT2Tokenizer") else None


def _as_byte_level_class_runs_it(
    tokenizer: Tokenizer, class_name: str, tokenizer_config: dict
) -> None:
    """``tokenizer`` (a BPE ``tokenizer.json``) with the pipeline transformers 5's
    ``class_name`` builds around its vocabulary and merges: byte-level BPE with
    ``add_prefix_space`` from ``tokenizer_config.json`` (default false), a ByteLevel
    decoder, and for ``Qwen2Tokenizer`` an NFC normalizer and Qwen's split before the
    bytes (GPT-2's has no normalizer). A file of another model type (WordPiece, Unigram)
    runs as written: the class would make a merge-less BPE of its vocabulary."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("model", {}).get("type") != "BPE":
        return
    add_prefix_space = bool(tokenizer_config.get("add_prefix_space") or False)
    if class_name == "Qwen2Tokenizer":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    else:
        tokenizer.normalizer = None
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    model = tokenizer.model
    model.dropout = None
    model.continuing_subword_prefix = ""
    model.end_of_word_suffix = ""
    model.fuse_unk = False
    model.unk_token = None
    model.byte_fallback = False


def _byte_level(spec: dict) -> bool:
    """Whether a tokenizer.json's pre-tokenizer or decoder is (or holds) ByteLevel."""

    def holds(part: object) -> bool:
        if not isinstance(part, dict):
            return False
        if part.get("type") == "ByteLevel":
            return True
        inner = part.get("pretokenizers") or part.get("decoders") or ()
        return any(holds(p) for p in inner)

    return holds(spec.get("pre_tokenizer")) or holds(spec.get("decoder"))


def check_tokenizer_files(directory: Path, spec: ArchSpec) -> None:
    """Refuse (InvalidCheckpoint) a ``tokenizer.json`` that does not load, cannot encode
    plain text or whose vocabulary holds ids the model's ``vocab_size`` lacks, and a chat
    template that does not compile."""
    tokenizer = load_tokenizer(directory, spec.family)
    try:
        tokenizer.encode(SAMPLE_TEXT)
    except Exception as exc:  # the library raises its own Exception for every problem
        raise InvalidCheckpoint(
            f"{TOKENIZER_FILE} in {str(directory)!r} loads but cannot encode the text "
            f"{SAMPLE_TEXT!r}, so no prompt in text could be served: {exc}"
        ) from None
    vocabulary = tokenizer.get_vocab(with_added_tokens=False)
    highest = max(vocabulary.values(), default=-1)
    if highest >= spec.vocab_size:
        raise InvalidCheckpoint(
            f"{TOKENIZER_FILE}'s vocabulary has token ids up to {highest} "
            f"({len(vocabulary)} tokens, added ones aside), but config.json's vocab_size "
            f"is {spec.vocab_size}: the model has no embedding row for ids "
            f"{spec.vocab_size} to {highest}, so vocab_size must be at least {highest + 1}"
        )
    try:
        template = read_chat_template(directory)
    except UnreadableChatTemplate as exc:
        raise InvalidCheckpoint(f"its chat template cannot be read: {exc}") from None
    except NoChatTemplate:
        return
    try:
        compile_template(template.text)
    except TemplateSyntaxError as exc:
        raise InvalidCheckpoint(
            f"the chat template in {template.source} does not compile: {exc.message} "
            f"(line {exc.lineno})"
        ) from None
