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
- a Llama or Code Llama tokenizer is run as transformers 5 runs it (below);
- the chat template the gateway renders (:mod:`services.models.chat_template`) must
  compile in the same Jinja environment. A checkpoint without one is fine: its chat
  requests are refused with the reason, and completions work.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateSyntaxError
from tokenizers import Tokenizer, decoders, pre_tokenizers

from services.models.arch import ArchSpec
from services.models.chat_template import (
    TOKENIZER_CONFIG,
    NoChatTemplate,
    compile_template,
    read_chat_template,
)
from services.models.checkpoint_files import read_json_object
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
        text = (directory / TOKENIZER_FILE).read_text(encoding="utf-8")
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
    return tokenizer


def _json_object(path: Path) -> dict:
    """``path``'s JSON object, {} when there is no such file (tokenizer_config.json is
    optional); InvalidCheckpoint naming it when it is there but not one: transformers
    refuses such a tokenizer, and its special tokens and chat template would be lost."""
    if not path.exists():
        return {}
    return read_json_object(path)


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

    Left as the file says: a byte-level ``tokenizer.json`` (Llama 3's, whose hub
    config still names ``LlamaTokenizer``: transformers runs the file); other model
    types (a ``mistral`` model runs the file whatever class is named); any other class.
    """
    named = str(tokenizer_config.get("tokenizer_class") or "").removesuffix("Fast")
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
    except NoChatTemplate:
        return
    try:
        compile_template(template.text)
    except TemplateSyntaxError as exc:
        raise InvalidCheckpoint(
            f"the chat template in {template.source} does not compile: {exc.message} "
            f"(line {exc.lineno})"
        ) from None
