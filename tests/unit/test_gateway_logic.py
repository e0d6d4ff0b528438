"""The gateway's pure logic: gRPC codes to HTTP, stop strings, chat templates."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway_svc.app import StopScanner, http_status
from gateway_svc.chat import ChatTemplateError, NoChatTemplate, read_template, render
from services.models.checkpoint import DEFAULT_CHAT_TEMPLATE


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_grpc_codes_map_to_openai_statuses(code, status):
    assert http_status(code)[0] == status


@given(
    st.lists(st.text(alphabet="abc", max_size=4), max_size=8),
    st.text(alphabet="abc", min_size=1, max_size=3),
)
def test_the_scanner_emits_exactly_the_text_before_the_first_stop(pieces, stop):
    scanner = StopScanner([stop])
    out = ""
    for piece in pieces:
        out += scanner.feed(piece)
        if scanner.stopped:
            break
    if not scanner.stopped:
        out += scanner.flush()
    whole = "".join(pieces)
    expected = whole[: whole.find(stop)] if stop in whole else whole
    assert out == expected
    assert scanner.stopped == (stop in whole)


def test_templates_render_as_transformers_does(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
                "{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
                "bos_token": {"content": "<s>", "special": True},
                "eos_token": "</s>",
            }
        )
    )
    template, tokens = read_template(tmp_path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render(template, messages, tokens) == "<s>[system]be brief[user]hi[assistant]"
    assert render(DEFAULT_CHAT_TEMPLATE, messages[1:], {}) == "<|user|>\nhi\n<|assistant|>\n"


def test_no_template_and_a_refusing_template_are_clear_errors(tmp_path):
    with pytest.raises(NoChatTemplate, match="no chat template"):
        read_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(NoChatTemplate, match="no chat template"):
        read_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(NoChatTemplate, match="not a JSON object"):
        read_template(tmp_path)
    named = [{"name": "tool_use", "template": "x"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    with pytest.raises(NoChatTemplate, match="no non-empty 'default'"):
        read_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe")
    with pytest.raises(NoChatTemplate, match="cannot read chat_template.jinja"):
        read_template(tmp_path)
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="user first"):
        render(strict, [{"role": "assistant", "content": "x"}], {})
    # The sandbox: a template cannot reach Python internals.
    with pytest.raises(ChatTemplateError):
        render("{{ messages.__class__.__mro__[1].__subclasses__() }}", [], {})
    with pytest.raises(ChatTemplateError, match="underscore"):
        render("{% set ns = namespace(_x=1) %}", [], {})
    # A template failing in Python (not jinja2) is the same clear refusal, not a 500.
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}], {})
    with pytest.raises(ChatTemplateError, match="(?i)expected an expression"):
        render("{% for %}", [], {})
