"""Chat prompts rendered from the checkpoint's own chat template, as transformers does.

transformers' ``apply_chat_template`` (5.x, read from its source and checked against it
by ``tests/unit/test_gateway_chat_parity.py``) works like this:

- **Where the template comes from.** ``chat_template.jinja`` beside the tokenizer is
  what ``save_pretrained`` writes. Named templates go in
  ``additional_chat_templates/<name>.jinja``. Older checkpoints keep the template in
  ``tokenizer_config.json``'s ``chat_template``, as a string or a list of
  ``{"name", "template"}``. The files take precedence over the config. Of several named
  templates, "default" is used.
- **How it is rendered.** With jinja2 in an immutable sandbox (``trim_blocks``,
  ``lstrip_blocks``, the ``loopcontrols`` extension), with these helpers:
  - ``raise_exception`` and ``strftime_now``;
  - a ``tojson`` that neither escapes HTML nor sorts keys;
  - ``dict``, and a ``namespace`` that refuses underscore names;
  - the ``{% generation %}`` tag, which marks the assistant's part for training masks.
- **Its variables.** ``messages``, whose keys with a ``None`` value are dropped and whose
  reasoning is aliased as ``reasoning_content`` and ``thinking``; ``add_generation_prompt``;
  and the tokenizer's named special tokens that are set.
- **How the text is encoded.** Without adding special tokens: the template writes its
  own BOS (the scheduler's ``prompt_has_special_tokens``).

This module does the same with jinja2 itself (transformers is not a dependency of the
gateway). So a model's own template, not a convention guessed here, decides how its
conversation is laid out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens a template sees.
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# The names a message's reasoning comes under; templates read the first or "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Files larger than this are not read as templates or tokenizer configs.
_MAX_FILE_BYTES = 16 << 20


class NoChatTemplate(ValueError):
    """The checkpoint has no chat template: the chat endpoint cannot lay out messages."""


class ChatTemplateError(ValueError):
    """The template refused the conversation (it called raise_exception) or failed."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own filter escapes <, >, & and ' for HTML and sorts keys; templates are
    # written against transformers' plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Namespace(Namespace):
    """jinja2's ``namespace`` refusing names that start with an underscore, which could
    reach the interpreter's internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes, got {name!r}"
            )


class _Dict:
    """``dict(...)`` for templates, without the class's other attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers records where the
    assistant's tokens are (for training masks); for a prompt it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


@lru_cache(maxsize=64)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _token_text(value: object) -> str | None:
    # A special token is a string or an AddedToken dict ({"content": ...}).
    if isinstance(value, Mapping):
        value = value.get("content")
    return None if value is None else str(value)


def _stamp(path: Path) -> tuple[str, int, int] | None:
    """(path, mtime, size) of a file, None when it is absent: a cache key that changes
    when the file does."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise NoChatTemplate(f"cannot read {path.name}: {exc}") from None
    return str(path), stat.st_mtime_ns, stat.st_size


def read_template(checkpoint_dir: Path) -> tuple[str, dict[str, str]]:
    """(chat template, special tokens) of a checkpoint; NoChatTemplate when it has none.

    The sources and their order are transformers' (see the module docstring).
    """
    names = []
    template_dir = checkpoint_dir / CHAT_TEMPLATE_DIR
    if template_dir.is_dir():
        names = sorted(p.name for p in template_dir.iterdir() if p.suffix == ".jinja")
    stamps = (
        _stamp(checkpoint_dir / TOKENIZER_CONFIG),
        _stamp(checkpoint_dir / SPECIAL_TOKENS_MAP),
        _stamp(checkpoint_dir / CHAT_TEMPLATE_FILE),
        tuple(_stamp(template_dir / name) for name in names),
    )
    template, tokens = _parse(*stamps)
    return template, dict(tokens)


def _read(stamp: tuple[str, int, int], what: str) -> str:
    path, _mtime, size = stamp
    if size > _MAX_FILE_BYTES:
        raise NoChatTemplate(f"{what} is {size} bytes, more than {_MAX_FILE_BYTES}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NoChatTemplate(f"cannot read {what}: {exc}") from None


def _json_object(stamp: tuple[str, int, int] | None, what: str) -> dict[str, Any]:
    if stamp is None:
        return {}
    try:
        value = json.loads(_read(stamp, what))
    except json.JSONDecodeError as exc:
        raise NoChatTemplate(f"cannot read {what}: {exc}") from None
    if not isinstance(value, dict):
        raise NoChatTemplate(f"{what} is not a JSON object")
    return value


@lru_cache(maxsize=64)
def _parse(config_stamp, tokens_map_stamp, file_stamp, named_stamps) -> tuple[str, tuple]:
    """The template and special tokens of one version of a checkpoint's tokenizer files
    (a chat request reads them again only when they changed)."""
    config = _json_object(config_stamp, TOKENIZER_CONFIG)
    templates: dict[str, str] = {}
    if file_stamp is not None:
        templates["default"] = _read(file_stamp, CHAT_TEMPLATE_FILE)
    for stamp in named_stamps:
        name = Path(stamp[0]).stem
        templates[name] = _read(stamp, f"{CHAT_TEMPLATE_DIR}/{name}.jinja")
    if not templates:
        configured = config.get("chat_template")
        if isinstance(configured, list):
            for entry in configured:
                if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                    templates[entry["name"]] = entry.get("template")
        elif configured is not None:
            templates["default"] = configured
    if not templates:
        raise NoChatTemplate(
            f"the model has no chat template ({CHAT_TEMPLATE_FILE}, or chat_template in "
            f"{TOKENIZER_CONFIG}); use /v1/completions with a prompt instead"
        )
    template = templates.get("default")
    if not isinstance(template, str) or not template.strip():
        raise NoChatTemplate(
            f"the model's chat templates {sorted(templates)} have no non-empty 'default' one; "
            "use /v1/completions with a prompt instead"
        )
    # transformers reads special_tokens_map.json only for a config without
    # added_tokens_decoder (older checkpoints), and then its values win.
    merged = dict(config)
    if "added_tokens_decoder" not in config:
        merged.update(_json_object(tokens_map_stamp, SPECIAL_TOKENS_MAP))
    tokens = {name: _token_text(merged.get(name)) for name in _SPECIAL_TOKENS}
    return template, tuple((name, text) for name, text in tokens.items() if text is not None)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as transformers hands them to a template: keys with a ``None`` value
    dropped, reasoning under ``reasoning_content`` and ``thinking`` too."""
    prepared = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def render(
    template: str,
    messages: Sequence[Mapping[str, object]],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of ``messages``; ChatTemplateError when the template refuses them."""
    try:
        return _compile(template).render(
            messages=template_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None
    except Exception as exc:  # the checkpoint's code failed (a TypeError, a bad index...)
        raise ChatTemplateError(
            f"the model's chat template failed on the messages: {type(exc).__name__}: {exc}"
        ) from None
