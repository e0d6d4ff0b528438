"""A checkpoint's tokenizer files, checked when it is registered.

A tokenizer the worker cannot load, ids the model has no embedding row for, or a chat
template that does not compile would otherwise pass registration and fail later, at
deploy or on every request, with an error that blames the wrong party. Each is refused
here, naming the file:

- ``tokenizer.json`` must load with the ``tokenizers`` library, as the worker loads it;
- the highest id of its model's vocabulary must be below the config's ``vocab_size``: a
  smaller one makes ordinary text fail. A larger ``vocab_size`` (rows padded to a round
  number) is fine, and so are added tokens beyond it (a ``<pad>`` appended at 32000 to a
  32000-row Llama-2, which transformers loads): only a prompt holding one is refused;
- the chat template the gateway renders (:mod:`services.models.chat_template`) must
  compile in the same Jinja environment. A checkpoint without one is fine: its chat
  requests are refused with the reason, and completions work.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateSyntaxError
from tokenizers import Tokenizer

from services.models.arch import ArchSpec
from services.models.chat_template import NoChatTemplate, compile_template, read_chat_template
from services.models.errors import InvalidCheckpoint

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(directory: Path) -> Tokenizer:
    """The checkpoint's ``tokenizer.json``, loaded as the worker loads it; InvalidCheckpoint
    naming the file when the ``tokenizers`` library cannot read it."""
    try:
        return Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    except Exception as exc:  # the library raises its own Exception for every problem
        raise InvalidCheckpoint(
            f"{TOKENIZER_FILE} in {str(directory)!r} is not a tokenizer the tokenizers "
            f"library can load: {exc}"
        ) from None


def check_tokenizer_files(directory: Path, spec: ArchSpec) -> None:
    """Refuse (InvalidCheckpoint) a ``tokenizer.json`` that does not load or whose
    vocabulary holds ids the model's ``vocab_size`` lacks, and a chat template that does
    not compile."""
    tokenizer = load_tokenizer(directory)
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
