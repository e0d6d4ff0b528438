"""Chat prompts rendered from the checkpoint's own ``chat_template``, as transformers does.

transformers' ``apply_chat_template`` renders the template stored in the checkpoint's
``tokenizer_config.json`` with jinja2 in a sandbox (``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension, ``raise_exception`` and ``strftime_now`` helpers), with
``messages``, ``add_generation_prompt`` and the tokenizer's special tokens as variables.
This module does the same with jinja2 itself, so that a model's own template (not a
convention guessed here) decides how its conversation is laid out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class NoChatTemplate(ValueError):
    """The checkpoint has no chat template: the chat endpoint cannot lay out messages."""


class ChatTemplateError(ValueError):
    """The template refused the conversation (it called raise_exception) or failed."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=64)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: object) -> str:
    # tokenizer_config.json holds a special token as a string or as an AddedToken dict.
    if isinstance(value, Mapping):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def read_template(checkpoint_dir: Path) -> tuple[str, dict[str, str]]:
    """(chat template, special tokens) of a checkpoint; NoChatTemplate when it has none.

    A config may hold several named templates (a list of {"name", "template"}); the one
    named "default" is used, as transformers does.
    """
    path = checkpoint_dir / TOKENIZER_CONFIG
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise NoChatTemplate(f"the checkpoint has no {TOKENIZER_CONFIG}") from None
    except OSError as exc:
        raise NoChatTemplate(f"cannot read {TOKENIZER_CONFIG}: {exc}") from None
    template, tokens = _parse(str(path), stat.st_mtime_ns, stat.st_size)
    return template, dict(tokens)


@lru_cache(maxsize=64)
def _parse(path: str, _mtime_ns: int, _size: int) -> tuple[str, dict[str, str]]:
    """The template and special tokens of one version of a tokenizer_config.json (a chat
    request reads the file again only when it changed)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise NoChatTemplate(f"cannot read {TOKENIZER_CONFIG}: {exc}") from None
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise NoChatTemplate(
            "the model's tokenizer_config.json has no chat_template; use /v1/completions "
            "with a prompt instead"
        )
    tokens = {name: _token_text(config.get(name)) for name in _SPECIAL_TOKENS}
    return template, tokens


def render(
    template: str,
    messages: Sequence[Mapping[str, object]],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of ``messages``; ChatTemplateError when the template refuses them."""
    try:
        return _compile(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None
