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

One departure, as vLLM's OpenAI server makes it: a message's text content parts reach a
template that never loops over a message's content as one string, the parts' texts
joined by newlines (:func:`loops_over_content`). transformers would hand such a template
the list, and ``{{ message['content'] }}`` would print the list's Python repr into the
prompt; OpenAI clients send parts and mean their text.

A template that refuses a conversation on purpose (``raise_exception``), or whose code
fails on these messages (a TypeError where it expected another shape of content),
answers the client's request (ChatTemplateError: what it met is named, and another
conversation may render); one that cannot render anything (it does not compile, or
reaches past the sandbox) is a fault of the model's checkpoint, not the request's
(BrokenChatTemplate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateSyntaxError, nodes
from jinja2.exceptions import SecurityError

from services.models.chat_template import (
    NoChatTemplate,
    TemplateRefusal,
    UnreadableChatTemplate,
    compile_template,
    read_chat_template,
)

__all__ = [
    "BrokenChatTemplate",
    "ChatTemplateError",
    "NoChatTemplate",
    "UnreadableChatTemplate",
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


def read_template(checkpoint_dir: Path, root: Path | None = None) -> tuple[str, dict[str, str]]:
    """(chat template, special tokens) of a checkpoint; NoChatTemplate when it has none,
    or when a file of it resolves outside ``root`` (the models root)."""
    template = read_chat_template(checkpoint_dir, root)
    return template.text, dict(template.special_tokens)


def _reads_content(node: nodes.Node, names: set[str]) -> bool:
    """Whether ``node`` reads a message's content: ``m['content']``, ``m.content`` (through
    filters or tests too), or a name set from one of them."""
    return any(
        (isinstance(found, nodes.Getitem) and getattr(found.arg, "value", None) == "content")
        or (isinstance(found, nodes.Getattr) and found.attr == "content")
        or (isinstance(found, nodes.Name) and found.name in names)
        for found in (node, *node.find_all((nodes.Getitem, nodes.Getattr, nodes.Name)))
    )


@lru_cache(maxsize=64)
def loops_over_content(template: str) -> bool:
    """Whether ``template`` iterates over a message's content (it reads content parts)
    anywhere, judged from its syntax tree as vLLM judges a template's content format.
    False for a template that does not parse (rendering it says why)."""
    try:
        tree = compile_template(template).environment.parse(template)
    except (TemplateSyntaxError, SecurityError):
        return False
    names: set[str] = set()
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _reads_content(assign.node, names):
            names.add(assign.target.name)
    return any(_reads_content(loop.iter, names) for loop in tree.find_all(nodes.For))


def _joined_text(content: Any) -> Any:
    """Text content parts as one string, their texts joined by newlines (as vLLM joins
    them for templates that read content as a string); other content as it is."""
    if isinstance(content, list) and all(
        isinstance(part, Mapping) and isinstance(part.get("text"), str) for part in content
    ):
        return "\n".join(part["text"] for part in content)
    return content


def template_messages(
    messages: Sequence[Mapping[str, Any]], *, join_text_parts: bool = False
) -> list[dict[str, Any]]:
    """``messages`` as transformers hands them to a template: keys with a ``None`` value
    dropped, reasoning under ``reasoning_content`` and ``thinking`` too; with
    ``join_text_parts``, text content parts as one string."""
    prepared = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        if join_text_parts and "content" in message:
            message["content"] = _joined_text(message["content"])
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
    variables: Mapping[str, object] | None = None,
) -> str:
    """The prompt text of ``messages``; ChatTemplateError when the template refuses them,
    BrokenChatTemplate when it fails of itself. ``variables``: the request's further
    template variables (``chat_template_kwargs``), over the special tokens' names as in
    transformers."""
    try:
        return compile_template(template).render(
            messages=template_messages(messages, join_text_parts=not loops_over_content(template)),
            add_generation_prompt=add_generation_prompt,
            **{**special_tokens, **(variables or {})},
        )
    except TemplateRefusal as exc:
        raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None
    except MemoryError:
        raise  # the render process's limit: the template's fault (gateway_svc.render_pool)
    # A recursion without end, or a range past the sandbox's bound: the template's own
    # doing whatever the messages (they were answered as the request's fault).
    except (TemplateSyntaxError, SecurityError, RecursionError, OverflowError) as exc:
        raise BrokenChatTemplate(
            "the model's chat template failed (a fault of the model's template, not of "
            f"the request): {type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:  # a TypeError, a bad index, an undefined name: these messages
        raise ChatTemplateError(
            "the model's chat template could not render these messages: "
            f"{type(exc).__name__}: {exc}"
        ) from None
