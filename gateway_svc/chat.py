"""Chat prompts rendered from the checkpoint's own chat template, as transformers does.

transformers' ``apply_chat_template`` (5.x, read from its source and checked against it
by ``tests/unit/test_gateway_chat_parity.py``) reads the template and compiles it in a
sandboxed Jinja environment that :mod:`services.models.chat_template` reproduces (where
registration compiles it too), then:

- **Its variables.** ``messages``, whose keys with a ``None`` value are dropped and whose
  reasoning is aliased as ``reasoning_content`` and ``thinking``; ``add_generation_prompt``;
  and the tokenizer's named special tokens that are set.
- **How the text is encoded.** Without adding special tokens: the template writes its
  own BOS (the scheduler's ``prompt_has_special_tokens``).

This module does the same with jinja2 (transformers is not a dependency of the gateway).
So a model's own template, not a convention guessed here, decides how its conversation
is laid out.

A template that refuses a conversation on purpose (``raise_exception``), or whose code
fails on these messages (a TypeError where it expected another shape of content),
answers the client's request (ChatTemplateError: what it met is named, and another
conversation may render); one that cannot render anything (it does not compile, or
reaches past the sandbox) is a fault of the model's checkpoint, not the request's
(BrokenChatTemplate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateSyntaxError
from jinja2.exceptions import SecurityError

from services.models.chat_template import (
    NoChatTemplate,
    TemplateRefusal,
    compile_template,
    read_chat_template,
)

__all__ = [
    "BrokenChatTemplate",
    "ChatTemplateError",
    "NoChatTemplate",
    "read_template",
    "render",
    "template_messages",
]

# The names a message's reasoning comes under; templates read the first or "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation (it called raise_exception, or its code
    failed on these messages): answered as the request's fault."""


class BrokenChatTemplate(RuntimeError):
    """The template cannot render any conversation (it does not compile, or it reaches
    past the sandbox): the model's fault, not the request's."""


def read_template(checkpoint_dir: Path) -> tuple[str, dict[str, str]]:
    """(chat template, special tokens) of a checkpoint; NoChatTemplate when it has none."""
    template = read_chat_template(checkpoint_dir)
    return template.text, dict(template.special_tokens)


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
    """The prompt text of ``messages``; ChatTemplateError when the template refuses them,
    BrokenChatTemplate when it fails of itself."""
    try:
        return compile_template(template).render(
            messages=template_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except TemplateRefusal as exc:
        raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None
    except MemoryError:
        raise  # the render process's limit: the template's fault (gateway_svc.render_pool)
    except (TemplateSyntaxError, SecurityError) as exc:
        raise BrokenChatTemplate(
            "the model's chat template failed (a fault of the model's template, not of "
            f"the request): {type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:  # a TypeError, a bad index, an undefined name: these messages
        raise ChatTemplateError(
            "the model's chat template could not render these messages: "
            f"{type(exc).__name__}: {exc}"
        ) from None
