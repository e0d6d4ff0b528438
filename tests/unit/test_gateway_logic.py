"""The gateway's pure logic: gRPC codes to HTTP, stop strings, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from gateway_svc.app import Backend, StopScanner, create_app, http_status
from gateway_svc.chat import (
    BrokenChatTemplate,
    ChatTemplateError,
    NoChatTemplate,
    read_template,
    render,
)
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


@pytest.mark.parametrize(
    ("template", "messages", "reason"),
    [
        # The sandbox: a template cannot reach Python internals.
        ("{{ messages.__class__.__mro__[1].__subclasses__() }}", [], "SecurityError"),
        ("{% set ns = namespace(_x=1) %}", [], "underscore"),
        # One that does not compile (registration refuses it; one edited since is caught here).
        ("{% for %}", [], "(?i)expected an expression"),
        ("{% for m in messages %}{{ m['content'] }{% endfor %}", [], "unexpected '}'"),
    ],
)
def test_a_template_failing_of_itself_is_not_the_requests_fault(template, messages, reason):
    with pytest.raises(BrokenChatTemplate, match=reason) as failed:
        render(template, messages, {})
    assert "not of the request" in str(failed.value)


def test_a_template_whose_code_fails_on_these_messages_refuses_them():
    # Content of a shape the template did not expect: another conversation may render.
    with pytest.raises(ChatTemplateError, match="could not render these messages: TypeError"):
        render("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}], {})


class _TemplateBackend(Backend):
    """A backend whose model has ``template``; nothing reaches a service before it renders."""

    def __init__(self, template: str):
        super().__init__(None, None, None, Path("."))
        self.template = template

    async def chat_template(self, model_id: str) -> tuple[str, dict[str, str]]:
        return self.template, {}


@pytest.mark.parametrize(
    ("template", "status", "kind", "says"),
    [
        ("{{ raise_exception('no system messages') }}", 400, "invalid_request_error", "no system"),
        ("{{ messages[0]['content'] }", 500, "internal_error", "not of the request"),
    ],
)
def test_the_chat_endpoint_blames_the_request_only_for_a_refusal(template, status, kind, says):
    app = create_app(lambda: _TemplateBackend(template))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["type"] == kind and says in error["message"]
