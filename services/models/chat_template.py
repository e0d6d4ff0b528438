"""A checkpoint's chat template: where it is read from, and the Jinja environment it runs in.

Both follow transformers' ``apply_chat_template`` (5.x, read from its source and checked
against it by ``tests/unit/test_gateway_chat_parity.py``); the gateway renders chat
prompts with them (``gateway_svc.chat``) and registration compiles the template with them
(``services.models.tokenizer_files``), so a template registration accepts is one the
gateway can run.

- **Where the template comes from.** ``chat_template.jinja`` beside the tokenizer is
  what ``save_pretrained`` writes. Named templates go in
  ``additional_chat_templates/<name>.jinja``. Older checkpoints keep the template in
  ``tokenizer_config.json``'s ``chat_template``, as a string or a list of
  ``{"name", "template"}``. The files take precedence over the config. Of several named
  templates, "default" is used. The tokenizer's named special tokens that are set come
  from ``tokenizer_config.json`` (or ``special_tokens_map.json`` for older checkpoints).
- **How it is compiled and rendered.** With jinja2 in an immutable sandbox
  (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension), with these helpers:
  - ``raise_exception`` (raising :class:`TemplateRefusal`) and ``strftime_now``;
  - a ``tojson`` that neither escapes HTML nor sorts keys;
  - ``dict``, and a ``namespace`` that refuses underscore names;
  - the ``{% generation %}`` tag, which marks the assistant's part for training masks.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from stat import S_ISREG
from typing import Any

import jinja2
from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from services.models import json_text
from services.models.checkpoint_files import CHAT_TEMPLATE_DIR

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
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
# Files larger than this are not read as templates or tokenizer configs.
MAX_TEMPLATE_FILE_BYTES = 16 << 20


class NoChatTemplate(ValueError):
    """The checkpoint has no chat template: the chat endpoint cannot lay out messages."""


class UnreadableChatTemplate(NoChatTemplate):
    """A file that holds (or may hold) the checkpoint's chat template is there but cannot
    be read: not a regular file, not UTF-8, too large, not JSON, or resolving outside the
    models root. The model's fault, not a request's: registration refuses it (such
    checkpoints registered, and every chat was then a 400 blaming the client, a tester)."""


class TemplateRefusal(TemplateError):
    """What a template's ``raise_exception(message)`` raises: the template refusing the
    conversation on purpose (roles out of order, an unsupported feature)."""


@dataclass(frozen=True)
class ChatTemplate:
    """The template the chat endpoint renders, and where it was read from."""

    source: str  # the file, relative to the checkpoint directory
    text: str
    # (name, text) of the named special tokens that are set (``bos_token``…).
    special_tokens: tuple[tuple[str, str], ...]


def _raise(message: str) -> None:
    raise TemplateRefusal(message)


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


# The longest string or sequence one operator may build in a template, and the largest
# power (in bits) it may raise a number to: far beyond any prompt's layout.
MAX_BUILT_LENGTH = 1 << 20
MAX_POWER_BITS = 4096


def _built_length(operator: str, left: object, right: object) -> int:
    """The length of the string or sequence ``left operator right`` would build (0 when
    it builds none)."""
    sized = (str, list, tuple)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(count, int):
                return len(seq) * max(count, 0)
    return 0


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' immutable sandbox, with ``*``, ``**`` and ``+`` bounded.

    Intercepted, those operators are also never folded at compile time: jinja2 computed
    a constant ``("x" * 100000000) * 100`` while compiling, and a registration took the
    model service (and 22 GB) down with it. Rendering gets a SecurityError instead (the
    template's fault). What the sandbox cannot bound this way (loops, strings joined with
    ``~``) the gateway bounds by rendering in processes of its own (gateway_svc.render_pool).
    """

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, operator, left, right):
        if _built_length(operator, left, right) > MAX_BUILT_LENGTH:
            raise jinja2.exceptions.SecurityError(
                f"chat templates may build at most {MAX_BUILT_LENGTH} characters or items "
                f"with {operator!r}"
            )
        if (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and right * abs(left).bit_length() > MAX_POWER_BITS
        ):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may raise numbers to at most {MAX_POWER_BITS} bits"
            )
        return super().call_binop(context, operator, left, right)


# Statements that load another template: transformers' environment has no loader, so a
# template holding one fails on every conversation ("no loader for this environment").
_LOADING = (nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)


@lru_cache(maxsize=64)
def compile_template(source: str) -> Template:
    """``source`` compiled in transformers' environment (nothing of it runs yet);
    jinja2's TemplateSyntaxError when it is not a valid template, or loads another one
    (``{% include %}``, ``{% import %}``, ``{% extends %}``): it could render nothing.
    Registration refuses such a template, and the gateway answers it as the model's
    fault, not the request's."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    loading = next(env.parse(source).find_all(_LOADING), None)
    if loading is not None:
        raise jinja2.TemplateSyntaxError(
            f"the template loads another template ({type(loading).__name__.lower()}), "
            "which a chat template cannot: there is no template loader",
            loading.lineno,
        )
    return env.from_string(source)


def _token_text(value: object) -> str | None:
    # A special token is a string or an AddedToken dict ({"content": ...}).
    if isinstance(value, Mapping):
        value = value.get("content")
    return None if value is None else str(value)


# A template file as read: (its name in the checkpoint, the path it resolved to, that
# file's mtime and size, the root it must lie in or ""). A cache key that changes when
# the file does, or when a link of the checkpoint points elsewhere.
_Stamp = tuple[str, str, int, int, str]


def _outside(path: Path) -> UnreadableChatTemplate:
    # Checked at registration too, but a file may be replaced by a link since: the
    # gateway rendered a link to the stack's token file, or to /proc/self/environ, into
    # a prompt (a probe), also when the link was swapped between a check and the read.
    return UnreadableChatTemplate(
        f"{path.name} links outside the models root; iserve only reads checkpoints "
        "under ISERVE_MODELS_ROOT"
    )


def _stamp(path: Path, root: Path | None) -> _Stamp | None:
    """The stamp of a file, None when it is absent. NoChatTemplate when ``root`` is
    given and the file resolves outside it (a link to a file elsewhere)."""
    try:
        resolved = path.resolve(strict=True)
        stat = resolved.stat()
    except FileNotFoundError:
        return None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a link loop (Python < 3.13)
        raise UnreadableChatTemplate(f"cannot read {path.name}: {exc}") from None
    if root is not None and not resolved.is_relative_to(root):
        raise _outside(path)
    if not S_ISREG(stat.st_mode):
        # A named pipe blocked the reader for ever (the model service, or the gateway's
        # event loop, every model's requests with it: a probe).
        raise UnreadableChatTemplate(f"{path.name} is not a regular file")
    return str(path), str(resolved), stat.st_mtime_ns, stat.st_size, str(root or "")


def read_chat_template(checkpoint_dir: Path, root: Path | None = None) -> ChatTemplate:
    """The chat template of a checkpoint; NoChatTemplate when it has none (or its files
    cannot be read, or one resolves outside ``root``, the models root, when given). The
    sources and their order are transformers' (see the module docstring); the files are
    read again only when they change."""
    root = None if root is None else root.resolve()
    names = []
    template_dir = checkpoint_dir / CHAT_TEMPLATE_DIR
    if template_dir.is_dir():
        names = sorted(p.name for p in template_dir.iterdir() if p.suffix == ".jinja")
    return _parse(
        _stamp(checkpoint_dir / TOKENIZER_CONFIG, root),
        _stamp(checkpoint_dir / SPECIAL_TOKENS_MAP, root),
        _stamp(checkpoint_dir / CHAT_TEMPLATE_FILE, root),
        tuple(_stamp(template_dir / name, root) for name in names),
    )


def _read(stamp: _Stamp, what: str) -> str:
    """The text of the file ``stamp`` resolved to, read from the file actually opened:
    not through a link (a link swapped in since the stamp fails the open), a regular
    file (a pipe would block), inside the stamp's root, at most MAX_TEMPLATE_FILE_BYTES."""
    name, resolved, _mtime, _size, root = stamp
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        raise UnreadableChatTemplate(f"cannot read {what}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as file:
        stat = os.fstat(fd)
        opened = Path(f"/proc/self/fd/{fd}")
        # A directory of the path swapped for a link since the stamp: where the file
        # opened really is.
        where = Path(os.readlink(opened)) if opened.is_symlink() else Path(resolved)
        if root and not where.is_relative_to(root):
            raise _outside(Path(name))
        if not S_ISREG(stat.st_mode):
            raise UnreadableChatTemplate(f"{what} is not a regular file")
        if stat.st_size > MAX_TEMPLATE_FILE_BYTES:
            raise UnreadableChatTemplate(
                f"{what} is {stat.st_size} bytes, more than {MAX_TEMPLATE_FILE_BYTES}"
            )
        data = file.read(MAX_TEMPLATE_FILE_BYTES + 1)
    if len(data) > MAX_TEMPLATE_FILE_BYTES:
        raise UnreadableChatTemplate(f"{what} is more than {MAX_TEMPLATE_FILE_BYTES} bytes")
    try:
        # As text mode reads it (transformers opens the file so): newlines translated.
        return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()
    except UnicodeDecodeError as exc:
        raise UnreadableChatTemplate(f"cannot read {what}: {exc}") from None


def _json_object(stamp: _Stamp | None, what: str) -> dict[str, Any]:
    if stamp is None:
        return {}
    try:
        value = json_text.loads(_read(stamp, what))
    except json.JSONDecodeError as exc:
        raise UnreadableChatTemplate(f"cannot read {what}: {exc}") from None
    if not isinstance(value, dict):
        raise UnreadableChatTemplate(f"{what} is not a JSON object")
    return value


@lru_cache(maxsize=64)
def _parse(config_stamp, tokens_map_stamp, file_stamp, named_stamps) -> ChatTemplate:
    """The template and special tokens of one version of a checkpoint's tokenizer files."""
    config = _json_object(config_stamp, TOKENIZER_CONFIG)
    # name: (file it came from, template)
    templates: dict[str, tuple[str, Any]] = {}
    if file_stamp is not None:
        templates["default"] = (CHAT_TEMPLATE_FILE, _read(file_stamp, CHAT_TEMPLATE_FILE))
    for stamp in named_stamps:
        name = Path(stamp[0]).stem  # the checkpoint's name for it, not its target's
        source = f"{CHAT_TEMPLATE_DIR}/{name}.jinja"
        templates[name] = (source, _read(stamp, source))
    if not templates:
        configured = config.get("chat_template")
        if isinstance(configured, list):
            for entry in configured:
                if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                    templates[entry["name"]] = (TOKENIZER_CONFIG, entry.get("template"))
        elif configured is not None:
            templates["default"] = (TOKENIZER_CONFIG, configured)
    if not templates:
        raise NoChatTemplate(
            f"the model has no chat template ({CHAT_TEMPLATE_FILE}, or chat_template in "
            f"{TOKENIZER_CONFIG}); use /v1/completions with a prompt instead"
        )
    source, template = templates.get("default", ("", None))
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
    return ChatTemplate(
        source=source,
        text=template,
        special_tokens=tuple((name, text) for name, text in tokens.items() if text is not None),
    )
