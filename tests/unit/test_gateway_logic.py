"""The gateway's pure logic: gRPC codes to HTTP, stop strings, chat templates."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from gateway_svc.app import UNMATCHED, Backend, GatewayError, create_app, http_status
from gateway_svc.chat import (
    BrokenChatTemplate,
    ChatTemplateError,
    NoChatTemplate,
    read_template,
    render,
)
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as inference_pb
from services.api import model_service_pb2 as model_pb
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


class _Refused(grpc.RpcError):
    """What a failed call raises: its code, details and trailing metadata."""

    def __init__(self, code, details, reason=""):
        self._code, self._details, self._reason = code, details, reason

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return (("iserve-reason", self._reason),) if self._reason else ()


def test_a_deployment_that_serves_nothing_is_a_503_not_the_clients_400():
    """A FAILED deployment asked for by id or by model was a 400 invalid_request_error:
    clients take a 400 for their own fault and do not retry (a probe)."""
    failed = GatewayError.from_rpc(
        _Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            "deployment d1 is FAILED: gave up after 0 restart(s)",
            "deployment_not_serving",
        ),
        "scheduler",
    )
    assert (failed.status, failed.kind, failed.code) == (
        503,
        "service_unavailable_error",
        "deployment_not_serving",
    )
    other = GatewayError.from_rpc(
        _Refused(grpc.StatusCode.FAILED_PRECONDITION, "no chat template"), "scheduler"
    )
    assert (other.status, other.kind) == (400, "invalid_request_error")


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
        # What fails on every conversation (a probe's, answered as the request's fault):
        # another template loaded with no loader there, a range past the sandbox's bound,
        # a recursion without end.
        ("{% include '/etc/passwd' %}", [], "loads another template"),
        ("{% import 'os' as os %}{{ os }}", [], "loads another template"),
        ("{% from 'x' import y %}", [], "loads another template"),
        ("{% extends 'base' %}", [], "loads another template"),
        ("{% for i in range(10**9) %}x{% endfor %}", [], "OverflowError"),
        ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", [], "RecursionError"),
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

    async def chat_template(self, model_id: str, caller) -> tuple[str, dict[str, str]]:
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


class _Call:
    """A Generate call that ends before any token."""

    async def read(self):
        return grpc.aio.EOF

    def cancel(self) -> bool:
        return False


class _Recorder:
    """An InferenceService stub that keeps the requests it is sent."""

    def __init__(self) -> None:
        self.requests: list[inference_pb.GenerateRequest] = []

    def Generate(self, request: inference_pb.GenerateRequest, metadata=()) -> _Call:
        self.requests.append(request)
        return _Call()


def _sent(path: str, body: dict) -> inference_pb.GenerateRequest:
    """The GenerateRequest the gateway makes of ``body``."""
    recorder = _Recorder()
    backend = _TemplateBackend(DEFAULT_CHAT_TEMPLATE)
    backend.inference = recorder
    with TestClient(create_app(lambda: backend)) as client:
        reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    (request,) = recorder.requests
    return request


def _document_takes(path: str, body: dict) -> bool:
    """Whether the gateway's OpenAPI document calls ``body`` a valid body of ``path``."""
    document = create_app(lambda: None).openapi()
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    root = {**schema["schema"], "components": document["components"]}
    return Draft202012Validator(root).is_valid(body)


COMPLETION = ("/v1/completions", {"model": "m", "prompt": "hi"})
CHAT = ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT])
def test_vllms_top_k_and_stop_token_ids_reach_the_sampling(path, body):
    sampling = _sent(path, {**body, "top_k": 40, "stop_token_ids": [7, 2**32 - 1, 3.0]}).sampling
    assert sampling.top_k == 40
    assert list(sampling.stop_token_ids) == [7, 2**32 - 1, 3]
    # vLLM's -1 and 0 turn top-k off, as absent does: the engine's 0.
    for off in ({"top_k": -1}, {"top_k": 0}, {"top_k": None}, {}):
        sampling = _sent(path, {**body, **off, "stop_token_ids": None}).sampling
        assert sampling.top_k == 0 and not sampling.stop_token_ids


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT])
def test_stop_token_ids_are_bounded(path, body):
    """Unbounded, one body of 32 prompts each copying 4 million ids held the gateway's
    event loop for 17 s and took gigabytes in the gateway and the scheduler."""
    from services.stop_strings import MAX_STOP_TOKEN_IDS

    most = [1] * MAX_STOP_TOKEN_IDS
    assert len(_sent(path, {**body, "stop_token_ids": most}).sampling.stop_token_ids) == len(most)
    too_many = {**body, "stop_token_ids": [*most, 1]}
    with TestClient(create_app(lambda: _TemplateBackend(DEFAULT_CHAT_TEMPLATE))) as client:
        reply = client.post(path, json=too_many)
    assert reply.status_code == 400
    assert f"at most {MAX_STOP_TOKEN_IDS} stop token ids" in reply.json()["error"]["message"]
    assert not _document_takes(path, too_many) and _document_takes(
        path, {**body, "stop_token_ids": most}
    )


# The fields a vLLM client sends that change the output and that the server does not
# have, each with a value that asks for the effect.
VLLM_DECLINED = [
    ("repetition_penalty", 1.2, "repetition penalties are not supported by this server"),
    ("min_p", 0.1, "min_p is not supported by this server"),
    ("min_tokens", 4, "min_tokens is not supported by this server"),
    ("use_beam_search", True, "beam search is not supported by this server"),
    ("length_penalty", 0.5, "length penalties (of beam search) are not supported by this server"),
    ("bad_words", ["no"], "bad_words is not supported by this server"),
    ("allowed_token_ids", [1, 2], "allowed_token_ids is not supported by this server"),
    ("guided_json", {"type": "object"}, "guided decoding is not supported by this server"),
    ("guided_regex", "[a-z]+", "guided decoding is not supported by this server"),
    ("guided_choice", ["yes", "no"], "guided decoding is not supported by this server"),
    ("guided_grammar", "root ::= 'a'", "guided decoding is not supported by this server"),
    ("include_stop_str_in_output", True, "include_stop_str_in_output is not supported by this server"),
    ("skip_special_tokens", False, "special tokens in the output (skip_special_tokens: false) are not supported by this server"),
    ("prompt_logprobs", 0, "prompt log-probabilities are not supported by this server"),
    # These were taken and ignored: the answer came back as if they were not sent.
    ("structured_outputs", {"choice": ["yes", "no"]}, "structured outputs (guided decoding) are not supported by this server"),
    ("logits_processors", ["some.module:Processor"], "logits processors are not supported by this server"),
    ("truncate_prompt_tokens", 2, "truncate_prompt_tokens is not supported by this server"),
    ("echo", True, "echo is not supported by this server"),
]  # fmt: skip
CHAT_DECLINED = [
    ("continue_final_message", True, "continue_final_message is not supported by this server"),
    ("chat_template", "{{ messages }}", "a chat template of the request's own is not supported by this server"),
    ("web_search_options", {}, "web search is not supported by this server"),
    ("verbosity", "low", "verbosity is not supported by this server"),
]  # fmt: skip
NOT_TOKEN_IDS = "stop_token_ids takes token ids (integers from 0 to 2^32-1)"
NOT_TOP_K = "top_k takes an integer from -1 to 2^32-1"
NOT_STREAMED = "stream_options is only allowed when stream is true"


@pytest.mark.parametrize(
    ("path", "body", "field", "value", "message"),
    [
        *[(*endpoint, *declined) for endpoint in (COMPLETION, CHAT) for declined in VLLM_DECLINED],
        *[(*CHAT, *declined) for declined in CHAT_DECLINED],
        (*COMPLETION, "top_k", -2, "Input should be greater than or equal to -1"),
        (*CHAT, "top_k", 2**32, "Input should be less than or equal to 4294967295"),
        # JSON's true and "3" are no counts, as in stop_token_ids.
        (*COMPLETION, "top_k", True, NOT_TOP_K),
        (*CHAT, "top_k", "3", NOT_TOP_K),
        (*COMPLETION, "stop_token_ids", [-1], NOT_TOKEN_IDS),
        (*CHAT, "stop_token_ids", [2**32], NOT_TOKEN_IDS),
        (*COMPLETION, "stop_token_ids", 7, NOT_TOKEN_IDS),
        (*CHAT, "tool_choice", "required", "tool calling is not supported by this server"),
        (*CHAT, "tool_choice", {"type": "function", "function": {"name": "f"}}, "tool calling is not supported by this server"),
        (*CHAT, "function_call", {"name": "f"}, "function calling is not supported by this server"),
        (*COMPLETION, "stream_options", {"include_usage": True}, NOT_STREAMED),
        (CHAT[0], {**CHAT[1], "stream": False}, "stream_options", {}, NOT_STREAMED),
        # 0 asks for the sampled token's log-probability (OpenAI, vLLM).
        (*COMPLETION, "logprobs", 0, "log-probabilities are not supported by this server"),
        # Without pydantic's "Value error, " before a validator's own message.
        (*COMPLETION, "stop", ["a", ""], "stop takes up to 4 strings of 1 to 1000 characters"),
    ],
)  # fmt: skip
def test_a_parameter_whose_effect_would_be_missing_is_a_400_naming_it(
    path, body, field, value, message
):
    app = create_app(lambda: _TemplateBackend(DEFAULT_CHAT_TEMPLATE))
    with TestClient(app) as client:
        reply = client.post(path, json={**body, field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] == f"{field}: {message}"
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert not _document_takes(path, {**body, field: value})  # the document says so too


# What pydantic's lax mode took and guessed at (max_tokens "5" and true as 5 and 1,
# stream "yes" as true): each is the wrong JSON type, which the document refuses, as
# OpenAI does.
WRONG_TYPES = [
    (COMPLETION, "max_tokens", "5", "Input should be a valid integer"),
    (CHAT, "max_tokens", True, "Input should be a valid integer"),
    (CHAT, "max_completion_tokens", "8", "Input should be a valid integer"),
    (COMPLETION, "seed", "3", "Input should be a valid integer"),
    (CHAT, "n", True, "Input should be a valid integer"),
    (COMPLETION, "deadline_ms", "100", "Input should be a valid integer"),
    (CHAT, "temperature", "0.5", "Input should be a valid number"),
    (COMPLETION, "top_p", True, "Input should be a valid number"),
    (CHAT, "stream", "yes", "Input should be a valid boolean"),
    (COMPLETION, "stream", 1, "Input should be a valid boolean"),
    (CHAT, "priority", "on", "Input should be a valid boolean"),
    (COMPLETION, "ignore_eos", 0, "Input should be a valid boolean"),
    (CHAT, "logprobs", "false", "Input should be a valid boolean"),
    (COMPLETION, "model", 5, "Input should be a valid string"),
]


@pytest.mark.parametrize(("endpoint", "field", "value", "message"), WRONG_TYPES)
def test_a_value_of_the_wrong_json_type_is_a_400_not_a_guess(endpoint, field, value, message):
    path, body = endpoint
    app = create_app(lambda: _TemplateBackend(DEFAULT_CHAT_TEMPLATE))
    with TestClient(app) as client:
        reply = client.post(path, json={**body, field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(f"{field}: {message}"), error
    assert error["param"] == field
    assert not _document_takes(path, {**body, field: value})


def test_nested_values_of_the_wrong_type_are_refused_too():
    app = create_app(lambda: _TemplateBackend(DEFAULT_CHAT_TEMPLATE))
    with TestClient(app) as client:
        for path, body in (
            (CHAT[0], {**CHAT[1], "stream": True, "stream_options": {"include_usage": "true"}}),
            (CHAT[0], {**CHAT[1], "messages": [{"role": "user", "content": 5}]}),
        ):
            reply = client.post(path, json=body)
            assert reply.status_code == 400, reply.text
            assert not _document_takes(path, body)


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT])
def test_an_integral_float_is_the_integer_json_schema_counts_it(path, body):
    taken = {**body, "max_tokens": 5.0, "seed": 7.0, "n": 1.0, "top_k": 3.0, "temperature": 0}
    sent = _sent(path, taken)
    assert (sent.max_tokens, sent.sampling.seed, sent.sampling.top_k) == (5, 7, 3)
    assert _document_takes(path, taken)


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT])
def test_the_neutral_values_of_declined_parameters_are_served(path, body):
    neutral = {
        "repetition_penalty": 1,
        "min_p": 0,
        "min_tokens": 0,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "bad_words": [],
        "allowed_token_ids": None,
        "guided_json": None,
        "guided_regex": None,
        "guided_choice": None,
        "guided_grammar": None,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "prompt_logprobs": None,
        "structured_outputs": None,
        "logits_processors": [],
        "truncate_prompt_tokens": None,
        "echo": False,
        "logprobs": False,
        "top_logprobs": 0,
        "stream_options": None,
    }
    served = [
        {**body, **neutral},
        {**body, "logprobs": None, "stop_token_ids": [], "top_k": -1},
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    ]
    if path == CHAT[0]:
        served += [{**body, "tool_choice": c, "function_call": c} for c in ("none", "auto", None)]
        served.append(
            {
                **body,
                "continue_final_message": False,
                "chat_template": None,
                "web_search_options": None,
                "verbosity": None,
                "add_generation_prompt": None,
                "chat_template_kwargs": None,
            }
        )
    for taken in served:
        _sent(path, taken)
        assert _document_takes(path, taken)


class _Deployments:
    """A DeploymentService stub: ``deployments`` are what the caller's token sees."""

    def __init__(self, deployments: list[deploy_pb.Deployment]) -> None:
        self.deployments = deployments
        self.callers: list[tuple] = []

    async def ListDeployments(self, request, timeout=None, metadata=()):
        self.callers.append(metadata)
        found = [d for d in self.deployments if request.model_id in ("", d.model_id)]
        return deploy_pb.ListDeploymentsResponse(deployments=found)

    async def GetDeployment(self, request, timeout=None, metadata=()):
        self.callers.append(metadata)
        for deployment in self.deployments:
            if deployment.deployment_id == request.deployment_id:
                return deploy_pb.GetDeploymentResponse(deployment=deployment)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.NOT_FOUND,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"deployment {request.deployment_id} not found",
        )


class _Models:
    """A ModelService stub whose every model's checkpoint is ``checkpoint_path``; it keeps
    the ids it was asked for (read with the gateway's own token)."""

    def __init__(self, checkpoint_path: str) -> None:
        self.checkpoint_path = checkpoint_path
        self.read: list[str] = []

    async def GetModel(self, request, timeout=None):
        self.read.append(request.model_id)
        model = model_pb.Model(model_id=request.model_id, checkpoint_path=self.checkpoint_path)
        return model_pb.GetModelResponse(model=model)


TOKEN = "isv_0123456789abcdef_" + "A" * 43


def _backend(
    tmp_path: Path, deployments: tuple[deploy_pb.Deployment, ...] = (), *, auth: bool = True
) -> Backend:
    """A backend on stubs; every model's checkpoint has the default chat template."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": DEFAULT_CHAT_TEMPLATE})
    )
    stubs = (_Recorder(), _Deployments(list(deployments)), _Models("ckpt"))
    return Backend(*stubs, tmp_path, auth=auth, health=_Health())


class _Health:
    """gRPC health's List, which the services answer for any token they know: TOKEN."""

    async def List(self, request, timeout, metadata):
        if dict(metadata).get("authorization") != f"Bearer {TOKEN}":
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAUTHENTICATED, None, None, details="invalid or revoked token"
            )


@pytest.mark.parametrize(
    ("model", "status", "says", "asked"),
    [
        # Listed, then asked whether zz9 is a deployment's id (whose model to ask for).
        ("zz9", 404, "model zz9 has no deployment", [(("authorization", f"Bearer {TOKEN}"),)] * 2),
        # No iserve id: not served here, asked of no service (OpenAI's 404, not a 400).
        ("Not/An/Id", 404, "model 'Not/An/Id' does not exist here (invalid model_id", []),
    ],
)
def test_a_chat_reads_no_model_record_before_the_caller_sees_a_deployment(
    tmp_path, model, status, says, asked
):
    backend = _backend(tmp_path)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(lambda: backend)) as client:
        reply = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["message"].startswith(says)
    assert reply.json()["error"]["param"] == "model"
    assert backend.models.read == []  # asked with the caller's token only
    assert backend.deployments.callers == asked


def test_a_chat_on_a_deployment_the_caller_sees_reads_the_template(tmp_path):
    seen = deploy_pb.Deployment(deployment_id="m1-0000", model_id="m1")
    backend = _backend(tmp_path, (seen,))
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(lambda: backend)) as client:
        reply = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert reply.status_code == 200, reply.text
    assert backend.models.read == ["m1"]
    (sent,) = backend.inference.requests
    assert sent.prompt == "<|user|>\nhi\n<|assistant|>\n"


@pytest.mark.parametrize(
    "authorization",
    [
        b"Bearer \xe9" + TOKEN.encode(),  # latin-1: gRPC metadata is ASCII
        b"Bearer " + b"a" * 60_000,  # past the services' metadata limit
        b"Bearer short",  # no token is under 24 characters
        b"Bearer " + TOKEN[:30].encode() + b"\x7f" + TOKEN[30:].encode(),
    ],
)
def test_what_cannot_be_a_token_is_a_401_before_any_call(tmp_path, authorization):
    backend = _backend(tmp_path)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(lambda: backend)) as client:
        replies = [
            client.get("/v1/models", headers=[(b"authorization", authorization)]),
            client.post(
                "/v1/chat/completions", json=body, headers=[(b"authorization", authorization)]
            ),
        ]
    for reply in replies:
        assert reply.status_code == 401, reply.text
        error = reply.json()["error"]
        assert error["type"] == "authentication_error"
        assert error["message"].startswith("the bearer token is not an iserve token")
        assert reply.headers["www-authenticate"] == 'Bearer realm="iserve"'
    assert backend.deployments.callers == [] and backend.inference.requests == []


def test_with_authentication_off_what_cannot_be_a_token_is_not_sent_on(tmp_path):
    # OpenAI's clients must send a key: those written for vLLM send a placeholder.
    backend = _backend(tmp_path, auth=False)
    with TestClient(create_app(lambda: backend)) as client:
        for authorization in (b"Bearer EMPTY", b"Bearer \xe9" + TOKEN.encode()):
            reply = client.get("/v1/models", headers=[(b"authorization", authorization)])
            assert reply.status_code == 200, reply.text
    assert backend.deployments.callers == [(), ()]


def test_a_model_whose_deployment_is_starting_is_a_503_to_retrieve_as_to_generate(tmp_path):
    """models.retrieve was a 404 (not retried by the SDKs) while a chat for the same
    model was a 503 with Retry-After (a tester); a FAILED deployment is no model here."""
    starting = deploy_pb.Deployment(
        deployment_id="m-1a2b3c4d",
        model_id="m",
        state=deploy_pb.DEPLOYMENT_STATE_STARTING,
        state_reason="restart 1 in 1 s after: worker rank 0 exited (-9)",
    )
    failed = deploy_pb.Deployment(
        deployment_id="f-1a2b3c4d", model_id="f", state=deploy_pb.DEPLOYMENT_STATE_FAILED
    )
    backend = _backend(tmp_path, (starting, failed), auth=False)
    with TestClient(create_app(lambda: backend)) as client:
        for asked in ("m", "m-1a2b3c4d"):
            reply = client.get(f"/v1/models/{asked}")
            assert reply.status_code == 503, reply.text
            assert reply.headers["retry-after"]
            message = reply.json()["error"]["message"]
            assert message.startswith(f"model '{asked}' has no ready deployment yet: ")
            assert "m-1a2b3c4d is STARTING (restart 1 in 1 s after: " in message
        assert client.get("/v1/models/f").status_code == 404
        assert client.get("/v1/models").json()["data"] == []  # listed once ready


def test_a_model_asked_for_by_a_long_name_is_echoed_cut_in_the_404(tmp_path):
    backend = _backend(tmp_path, auth=False)
    with TestClient(create_app(lambda: backend)) as client:
        reply = client.get(f"/v1/models/{'m' * 60_000}")
    assert reply.status_code == 404, reply.text
    message = reply.json()["error"]["message"]
    assert message.endswith("... (60000 characters) has no ready deployment"), message
    assert len(message) < 200


def test_metrics_count_requests_by_route_not_by_the_path_sent(tmp_path):
    backend = _backend(tmp_path, auth=False)
    with TestClient(create_app(lambda: backend)) as client:
        client.get("/metrics")
        for i in range(50):
            assert client.get(f"/v1/models/secret-model-{i}").status_code == 404
            assert client.get(f"/probe-{i}/{'x' * 200}").status_code == 404
        assert client.get("/v1/completions").status_code == 405
        too_large = client.post("/v1/completions", headers={"content-length": "x"})
        assert too_large.status_code == 413
        after = client.get("/metrics").text
    assert "secret-model" not in after and "probe-" not in after
    counted = {
        line.split(" ")[0].removeprefix("iserve_gateway_requests_total")
        for line in after.splitlines()
        if line.startswith("iserve_gateway_requests_total")
    }
    # A method the route does not take, and a body refused before routing, are the route's.
    assert counted == {
        '{endpoint="/metrics",status="200"}',
        '{endpoint="/v1/models/{model_id}",status="404"}',
        f'{{endpoint="{UNMATCHED}",status="404"}}',
        '{endpoint="/v1/completions",status="405"}',
        '{endpoint="/v1/completions",status="413"}',
    }


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT])
@pytest.mark.parametrize("model", ["meta-llama/Llama-3-8B", "Tiny"])
def test_a_model_name_no_iserve_id_can_be_is_a_404_as_openai_gives(path, body, model):
    """A hub name or capitals cannot name a model here: OpenAI's 404 for a model it does
    not serve (clients fall back on it), not a 400."""
    recorder = _Recorder()
    backend = _TemplateBackend(DEFAULT_CHAT_TEMPLATE)
    backend.inference = recorder
    with TestClient(create_app(lambda: backend)) as client:
        reply = client.post(path, json={**body, "model": model})
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["type"] == "not_found_error" and error["param"] == "model"
    assert error["message"].startswith(f"model '{model}' does not exist here (invalid model_id")
    assert recorder.requests == []


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT])
def test_null_for_openais_nullable_fields_is_their_default(path, body):
    """The openai client sends None as null (temperature=None: "not set")."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "seed": None}
    sent = _sent(path, {**body, **nulls})
    assert (sent.sampling.temperature, sent.sampling.top_p) == (1.0, 1.0)
    assert _document_takes(path, {**body, **nulls})


def test_a_completion_without_max_tokens_sends_openais_16_as_a_default_to_cap():
    """OpenAI's completions generate 16 tokens when max_tokens is absent or null. Sent
    as max_tokens 16, a deployment allowing fewer output tokens refused a request whose
    client set no max_tokens; sent as max_tokens_default, the scheduler caps it."""
    path, body = COMPLETION
    for unset in (body, {**body, "max_tokens": None}):
        sent = _sent(path, {k: v for k, v in unset.items() if k != "max_tokens" or v is None})
        assert (sent.max_tokens, sent.max_tokens_default) == (0, 16)
    sent = _sent(path, {**body, "max_tokens": 16})
    assert (sent.max_tokens, sent.max_tokens_default) == (16, 0)


def test_max_completion_tokens_is_a_completions_limit_as_it_is_a_chats():
    """OpenAI's newer name, which the README says both endpoints take: a completion
    dropped it as an unknown field and generated 16 tokens (a tester)."""
    for path, body in (COMPLETION, CHAT):
        given = {k: v for k, v in body.items() if k != "max_tokens"}
        sent = _sent(path, {**given, "max_completion_tokens": 3})
        assert (sent.max_tokens, sent.max_tokens_default) == (3, 0)
        sent = _sent(path, {**given, "max_tokens": 9, "max_completion_tokens": 3})
        assert sent.max_tokens == 3  # the newer name wins, as a chat's did


def test_a_chat_is_not_refused_while_the_model_service_does_not_answer(tmp_path):
    """The chat template is read from the checkpoint the model record names. With the
    model service down (restarting), a model whose record was read before keeps its
    chats; every chat got a 503 (completions, which need no record, kept working). An
    answer that is a refusal (the model is gone) is still passed on."""
    import asyncio

    from services.models.checkpoint import create_checkpoint

    create_checkpoint(tmp_path / "ckpt", hidden_size=32, num_layers=1, num_heads=4)

    class Models:
        def __init__(self):
            self.answer: grpc.StatusCode | None = None  # None: the record

        async def GetModel(self, request, timeout):
            if self.answer is None:
                return model_pb.GetModelResponse(
                    model=model_pb.Model(model_id=request.model_id, checkpoint_path="ckpt")
                )
            raise grpc.aio.AioRpcError(self.answer, None, None, details="said so")

    models = Models()
    # No deployment is named "m" or "other": a NOT_FOUND stays the model service's.
    backend = Backend(None, _Deployments([]), models, tmp_path)

    async def scenario():
        template, _ = await backend.chat_template("m", ())
        models.answer = grpc.StatusCode.UNAVAILABLE
        assert (await backend.chat_template("m", ()))[0] == template
        with pytest.raises(GatewayError) as never_read:
            await backend.chat_template("other", ())  # no record read before: 503
        assert never_read.value.status == 503
        models.answer = grpc.StatusCode.NOT_FOUND
        with pytest.raises(GatewayError) as gone:
            await backend.chat_template("m", ())
        assert gone.value.status == 404

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": "not a list"},
        {"model": "Meta/x", "messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "prompt": [-1] * 10},
    ],
)
def test_with_authentication_on_a_request_without_a_token_is_refused_before_its_body(body):
    """OpenAI answers 401 first; here a body was validated (seconds of work for a 32 MiB
    one) and refused with 400 or 404 before the missing token was noticed."""
    backend = _TemplateBackend("{{ messages }}")
    backend.auth = True
    app = create_app(lambda: backend)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with TestClient(app) as client:
        reply = client.post(path, json=body)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["type"] == "authentication_error"
        # With a token, the body is judged as before.
        reply = client.post(path, json=body, headers={"Authorization": "Bearer EMPTY"})
        assert reply.status_code == 401  # "EMPTY" cannot be an iserve token


def test_with_authentication_on_a_token_the_services_refuse_is_refused_before_its_body():
    """A token of the right shape that no service knows had its body parsed and
    validated (four 30 MB ones held the gateway's loop for seconds: a probe); the
    services are asked first, and the body is judged only for a token they accept."""
    forged = "isv_0123456789abcdef_" + "A" * 43
    real = "isv_fedcba9876543210_" + "B" * 43

    class Checked(_TemplateBackend):
        asked: list[str] = []

        async def check_token(self, caller) -> None:
            token = dict(caller)["authorization"].removeprefix("Bearer ")
            self.asked.append(token)
            if token != real:
                raise GatewayError(401, "authentication_error", "invalid or revoked token")

    backend = Checked("{{ messages }}")
    backend.auth = True
    bad_body = {"model": "m", "messages": "not a list"}
    with TestClient(create_app(lambda: backend)) as client:
        for path in ("/v1/chat/completions", "/v1/completions"):
            refused = client.post(
                path, json=bad_body, headers={"Authorization": f"Bearer {forged}"}
            )
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["message"] == "invalid or revoked token"
            judged = client.post(path, json=bad_body, headers={"Authorization": f"Bearer {real}"})
            assert judged.status_code == 400, judged.text
    assert backend.asked == [forged, real] * 2


def test_a_chat_of_more_messages_or_content_parts_than_the_limit_is_refused_at_once():
    from gateway_svc.bodies import MAX_MESSAGES

    app = create_app(lambda: _TemplateBackend("{{ messages }}"))
    many = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    parts = [{"type": "text", "text": "a"}] * (MAX_MESSAGES // 2 + 1)
    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", json={"model": "m", "messages": many})
        assert reply.status_code == 400, reply.text
        assert f"at most {MAX_MESSAGES} messages per request" in reply.json()["error"]["message"]
        split = [{"role": "user", "content": parts}, {"role": "user", "content": parts}]
        reply = client.post("/v1/chat/completions", json={"model": "m", "messages": split})
        assert reply.status_code == 400, reply.text
        assert f"at most {MAX_MESSAGES} content parts" in reply.json()["error"]["message"]


def test_a_chat_whose_extra_fields_hold_too_many_values_is_refused_before_its_render():
    """8 million empty objects in a message's field of its own were copied to a render
    process, which ran out of memory: a 500 blaming the model's template (a tester)."""
    from gateway_svc.bodies import MAX_TEMPLATE_VALUES, _more_values_than

    assert not _more_values_than([1, [2, 3], {"a": [4]}], 7)
    assert _more_values_than([1, [2, 3], {"a": [4]}], 6)
    app = create_app(lambda: _TemplateBackend("{{ messages }}"))
    flood = [{}] * MAX_TEMPLATE_VALUES
    with TestClient(app) as client:
        for body in (
            {"messages": [{"role": "user", "content": "hi", "x": flood}]},
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": flood}},
        ):
            reply = client.post("/v1/chat/completions", json={"model": "m", **body})
            assert reply.status_code == 400, reply.text
            assert (
                f"more than {MAX_TEMPLATE_VALUES} JSON values" in reply.json()["error"]["message"]
            )


def test_token_ids_checked_in_bulk_refuse_what_the_item_check_refuses():
    from gateway_svc.bodies import _token_ids

    assert _token_ids([0, 5, 2**32 - 1]) == [0, 5, 2**32 - 1]
    assert _token_ids([1, 7.0]) == [1, 7]
    for bad in ([1, -1], [2**32], [True, 1], [1, 2.5], [1, "2"], [None]):
        assert _token_ids(bad) is None, bad


@pytest.mark.parametrize("top_p", [0, 1e-46, 5e-324])
def test_a_top_p_too_small_for_the_messages_float32_is_greedy(top_p):
    """top_p 0 and any positive top_p that float32 rounds to 0 keep the likeliest token
    only: greedy. 1e-46 reached the worker as 0, "unset", and sampled from everything."""
    sent = _sent(*COMPLETION[:1], {**COMPLETION[1], "top_p": top_p, "temperature": 1.0})
    assert (sent.sampling.temperature, sent.sampling.top_p) == (0.0, 1.0)
    kept = _sent(*COMPLETION[:1], {**COMPLETION[1], "top_p": 1e-30, "temperature": 1.0})
    assert kept.sampling.temperature == 1.0 and 0 < kept.sampling.top_p < 1e-29


def test_the_chat_template_takes_add_generation_prompt_and_the_request_s_variables():
    """vLLM's add_generation_prompt and chat_template_kwargs reach the template, as
    transformers' apply_chat_template passes them (they were taken and ignored)."""
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
        "{{ bos_token | default('') }}"
    )
    backend = _TemplateBackend(template)
    recorder = backend.inference = _Recorder()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(lambda: backend)) as client:
        for extra in (
            {},
            {"add_generation_prompt": False},
            {"chat_template_kwargs": {"enable_thinking": False, "bos_token": "<s>"}},
        ):
            reply = client.post("/v1/chat/completions", json={**body, **extra})
            assert reply.status_code == 200, reply.text
    prompts = [request.prompt for request in recorder.requests]
    assert prompts == ["<user>hi<assistant>", "<user>hi", "<user>hi<assistant><no-think><s>"]


def test_a_broken_chat_template_is_logged_for_the_operator(caplog):
    """A 500 the model's own template causes reached the client alone."""
    app = create_app(lambda: _TemplateBackend("{{ messages[0]['content'] }"))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as client, caplog.at_level("ERROR", logger="iserve.gateway"):
        assert client.post("/v1/chat/completions", json=body).status_code == 500
    assert any(
        "model 'm'" in r.getMessage() and "TemplateSyntaxError" in r.getMessage()
        for r in caplog.records
    ), caplog.records


def test_a_template_file_the_gateway_cannot_read_is_the_models_fault(tmp_path, caplog):
    """A chat_template.jinja made unreadable after registration (which now refuses one)
    was a 400 blaming the request (a tester): a 500 naming the model, logged."""
    backend = _backend(tmp_path, auth=False)
    (tmp_path / "ckpt" / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with (
        TestClient(create_app(lambda: backend)) as client,
        caplog.at_level("ERROR", logger="iserve.gateway"),
    ):
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 500, reply.text
    assert "model 'm': cannot read chat_template.jinja" in reply.json()["error"]["message"]
    assert any("cannot read chat_template.jinja" in r.getMessage() for r in caplog.records)
    # A model with no template at all is still the request's to change: a 400.
    (tmp_path / "ckpt" / "chat_template.jinja").unlink()
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text("{}")
    with TestClient(create_app(lambda: backend)) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 400


def test_template_variables_a_request_may_not_set_are_a_400_naming_them():
    app = create_app(lambda: _TemplateBackend(DEFAULT_CHAT_TEMPLATE))
    with TestClient(app) as client:
        for variables in (
            {"messages": []},
            {"_private": 1},
            {"a-b": 1},
            {f"v{i}": i for i in range(65)},
        ):
            body = {**CHAT[1], "chat_template_kwargs": variables}
            reply = client.post(CHAT[0], json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "chat_template_kwargs", error
            assert (
                "no variable a request may set" in error["message"]
                or "at most 64" in error["message"]
            )
            assert not _document_takes(CHAT[0], body)


def test_with_authentication_on_a_path_not_served_is_a_401_without_a_token(tmp_path):
    """OpenAI answers 401 before 404: a client without a key learned which paths exist."""
    backend = _backend(tmp_path)
    with TestClient(create_app(lambda: backend)) as client:
        for method, path in (
            ("post", "/v1/embeddings"),
            ("get", "/v1/responses"),
            ("delete", "/v1/models"),
        ):
            refused = client.request(method, path, json={})
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["type"] == "authentication_error"
            assert refused.headers["www-authenticate"] == 'Bearer realm="iserve"'
            keyed = client.request(
                method, path, json={}, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert keyed.status_code in (404, 405), keyed.text
        assert client.get("/nowhere").status_code == 404  # not an OpenAI path: no token asked


def test_with_authentication_on_a_body_that_is_not_json_is_a_401_without_a_token(tmp_path):
    """FastAPI parses the JSON before it solves the Caller dependency: the parse error
    (a 400 saying what the parser met, or a 415 for the content-type) came first, to a
    client without a key."""
    backend = _backend(tmp_path)
    with TestClient(create_app(lambda: backend)) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in (b"notjson", b'{"model": '):
                for media in ("application/json", "text/plain"):  # 415 with a key
                    refused = client.post(path, content=body, headers={"content-type": media})
                    assert refused.status_code == 401, refused.text
                    assert refused.json()["error"]["type"] == "authentication_error"
                keyed = client.post(
                    path,
                    content=body,
                    headers={
                        "content-type": "application/json",
                        "Authorization": f"Bearer {TOKEN}",
                    },
                )
                assert keyed.status_code == 400, keyed.text
                assert "not valid JSON" in keyed.json()["error"]["message"]


class _FirstRead:
    """A Generate call whose first read answers ``reply`` or raises ``error``."""

    def __init__(self, reply=None, error=None) -> None:
        self.reply, self.error = reply, error

    async def read(self):
        if self.error is not None:
            raise self.error
        return self.reply

    def cancel(self) -> None:
        pass


class _FakeChannel:
    """A channel whose Generate calls are ``calls``, in order."""

    def __init__(self, *calls: _FirstRead) -> None:
        self.calls, self.closed = list(calls), False

    def unary_stream(self, *args, **kwargs):
        return lambda request, metadata=(): self.calls.pop(0)

    def unary_unary(self, *args, **kwargs):
        return None

    async def close(self) -> None:
        self.closed = True


def _draining_error() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="scheduler is draining: it is shutting down and takes no new requests; "
        "retry on another instance or once it is back",
    )


def test_a_draining_scheduler_is_dialled_again_and_the_request_goes_on(tmp_path, monkeypatch):
    """A gateway keeps one connection to the scheduler's address; during a Kubernetes
    rollout that reached the old, draining pod, and every new request got its 503 for up
    to the drain timeout. Refused as draining before any token, a request is sent once
    more over a fresh connection; the old one stays open for its streams, then closes."""
    import asyncio

    from gateway_svc import app as app_module
    from services.api import inference_service_pb2_grpc

    answer = inference_pb.GenerateResponse(request_id="r")
    old = _FakeChannel(_FirstRead(error=_draining_error()), _FirstRead(error=_draining_error()))
    fresh = _FakeChannel(_FirstRead(reply=answer))
    dialled = []

    class Transport:
        @staticmethod
        def aio_channel(address, token=None):
            dialled.append(address)
            return fresh

    monkeypatch.setattr(app_module.transport, "current", lambda: Transport)
    request = inference_pb.GenerateRequest(prompt="hi")

    async def scenario():
        backend = Backend(
            inference_service_pb2_grpc.InferenceServiceStub(old),
            _Deployments([]),
            None,
            tmp_path,
            channels=(old, None, None),
            scheduler_address="scheduler:50064",
            retire_after_s=0.05,
        )
        generation = await app_module._open(backend, request)
        assert generation.first == answer and dialled == ["scheduler:50064"]
        assert backend.channels[0] is fresh and not old.closed
        await asyncio.sleep(0.2)
        assert old.closed  # after its streams' grace
        # Without an address to dial again (or again within a second), the 503 stands.
        stuck = Backend(
            inference_service_pb2_grpc.InferenceServiceStub(old),
            _Deployments([]),
            None,
            tmp_path,
            channels=(old, None, None),
        )
        with pytest.raises(GatewayError) as refused:
            await app_module._open(stuck, request)
        assert refused.value.status == 503 and "draining" in str(refused.value)

    asyncio.run(scenario())


def test_a_gateway_on_a_port_in_use_says_so_naming_its_variable(tmp_path):
    """uvicorn logged "Application startup complete" and then exited 3 on a port in use;
    the gateway binds first and stops with the address and the variable to change."""
    import os
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
        env.update(ISERVE_STATE_DIR=str(tmp_path), ISERVE_GATEWAY_ADDR=address)
        done = subprocess.run(
            [sys.executable, "-m", "gateway_svc"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert f"error: cannot bind {address}: Address already in use (set ISERVE_GATEWAY_ADDR" in (
        done.stderr
    )
    assert "startup complete" not in done.stderr


NEEDS_CONTENT = "message needs content"
NEEDS_CALL_ID = "a tool message needs tool_call_id"


@pytest.mark.parametrize(
    ("message", "refused"),
    [
        ({"role": "user"}, f"a user {NEEDS_CONTENT}"),
        ({"role": "user", "content": None}, f"a user {NEEDS_CONTENT}"),
        ({"role": "system", "content": None}, f"a system {NEEDS_CONTENT}"),
        ({"role": "tool", "tool_call_id": "c1"}, f"a tool {NEEDS_CONTENT}"),
        ({"role": "assistant"}, f"an assistant {NEEDS_CONTENT}"),
        ({"role": "assistant", "content": None, "tool_calls": None}, f"an assistant {NEEDS_CONTENT}"),
        ({"role": "assistant", "content": None, "tool_calls": []}, f"an assistant {NEEDS_CONTENT}"),
        ({"role": "assistant", "function_call": None}, f"an assistant {NEEDS_CONTENT}"),
        ({"role": "user", "content": ""}, None),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, None),
        ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, None),
        # OpenAI refuses a tool message without the call it answers; it was served (a tester).
        ({"role": "tool", "content": "42"}, NEEDS_CALL_ID),
        ({"role": "tool", "content": "42", "tool_call_id": ""}, NEEDS_CALL_ID),
        ({"role": "tool", "content": "42", "tool_call_id": 7}, NEEDS_CALL_ID),
        ({"role": "tool", "content": "42", "tool_call_id": "c1"}, None),
    ],
)  # fmt: skip
def test_a_message_without_content_is_refused_unless_an_assistant_made_calls(message, refused):
    """OpenAI's rule. A user message without content was served: the template rendered an
    empty turn and the model answered words nobody wrote."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, message]}
    # The document says so too.
    assert _document_takes("/v1/chat/completions", body) is (refused is None)
    if refused is None:
        assert _sent("/v1/chat/completions", body).prompt
        return
    with TestClient(create_app(lambda: _TemplateBackend(DEFAULT_CHAT_TEMPLATE))) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(f"messages.1: {refused}"), error
    assert error["param"] == "messages.1"


def test_a_server_side_failure_is_logged_and_a_clients_own_error_is_not(tmp_path, caplog):
    """The gateway answered 503s (the scheduler down) and wrote nothing of them (a probe)."""

    class Failing(_Deployments):
        """Every ListDeployments fails with ``code`` and ``details``."""

        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            super().__init__([])
            self.code, self.details = code, details

        async def ListDeployments(self, request, timeout=None, metadata=()):
            raise grpc.aio.AioRpcError(
                self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=self.details
            )

    unreachable = Failing(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    backend = Backend(_Recorder(), unreachable, _Models("ckpt"), tmp_path, auth=False)
    with (
        caplog.at_level(logging.WARNING, logger="iserve.gateway"),
        TestClient(create_app(lambda: backend)) as client,
    ):
        assert client.get("/v1/models").status_code == 503
        assert client.post("/v1/completions", json={"model": "m"}).status_code == 400
    said = [r.getMessage() for r in caplog.records if r.name == "iserve.gateway"]
    assert any(m.startswith("GET /v1/models -> 503 ") for m in said), said
    assert "failed to connect to all addresses" in "".join(said)
    assert not any("/v1/completions" in m for m in said), said

    # A deadline's 504 (EDF refusing a first token it predicts late: admission control
    # at work) is an INFO line, not one WARNING each, hundreds a minute under overload.
    late = Failing(grpc.StatusCode.DEADLINE_EXCEEDED, "request r cannot meet its deadline")
    caplog.clear()
    backend = Backend(_Recorder(), late, _Models("ckpt"), tmp_path, auth=False)
    with (
        caplog.at_level(logging.INFO, logger="iserve.gateway"),
        TestClient(create_app(lambda: backend)) as client,
    ):
        assert client.get("/v1/models").status_code == 504
    told = [r for r in caplog.records if "-> 504" in r.getMessage()]
    assert [r.levelname for r in told] == ["INFO"], caplog.records


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
)


def _structure(value) -> tuple[int, int]:
    """(objects, arrays, keys and floats in ``value``; its floats)."""
    if isinstance(value, dict):
        counts = [_structure(v) for v in value.values()]
        return 1 + len(value) + sum(c for c, _ in counts), sum(f for _, f in counts)
    if isinstance(value, list):
        counts = [_structure(v) for v in value]
        return 1 + sum(c for c, _ in counts), sum(f for _, f in counts)
    return (1, 1) if isinstance(value, float) else (0, 0)


@given(value=_JSON_VALUES, ascii_only=st.booleans())
@settings(max_examples=300, deadline=None)
def test_the_body_s_structure_is_counted_outside_its_strings(value, ascii_only):
    """The cheap count never undercounts; past the bound (0 here), what strings hold
    (quotes, backslashes, brackets, colons, e) is not counted, and a float counts once
    for its point and once for its exponent at most."""
    from gateway_svc.app import json_structure

    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    structure, floats = _structure(value)
    assert json_structure(body) >= structure
    assert structure <= json_structure(body, bound=0) <= structure + floats


def test_strings_across_the_count_s_slices_are_followed():
    """Past the cheap count, the body is read a MiB at a time: strings (with escaped
    quotes and backslashes) that cross from one slice to the next stay strings."""
    from gateway_svc.app import _STRUCTURE_SLICE, json_structure

    text = "{:[" * 300 + '"\\'  # most of the body: most slices start in a string
    items = 4 * _STRUCTURE_SLICE // len(text)
    body = json.dumps([text, 1.5] * items).encode()
    assert len(body) > 4 * _STRUCTURE_SLICE
    # The marks in the strings take it past the bound; those outside stay within it.
    assert json_structure(body, bound=3 * items) == 1 + items


def test_a_body_of_more_keys_arrays_or_decimals_than_the_bound_is_a_413_before_parsing():
    """2.4 million keys in 30 MB took the event loop 2 s to parse, and 4 such bodies held
    a short completion 21 s (a tester): refused once read, before FastAPI parses them. The
    same marks inside strings (code in a prompt) are no structure."""
    from gateway_svc.app import MAX_BODY_STRUCTURE, json_structure

    bound = MAX_BODY_STRUCTURE
    keys = {f"k{i}": 0 for i in range(bound)}
    hostile = [
        {"model": "m", "prompt": "hi", **keys},
        {"model": "m", "prompt": "hi", "x": [[]] * bound},
        {"model": "m", "prompt": "hi", "x": [0.5] * (bound + 1)},
    ]
    # Parsed, then refused for its max_tokens: read past the 413's check.
    user = '{"e": [1.5], "\\\\": "\\""}' * bound
    inside = {"model": "m", "prompt": "hi", "max_tokens": -1, "user": user}
    assert json_structure(json.dumps(inside).encode()) < 10
    app = create_app(lambda: _TemplateBackend(DEFAULT_CHAT_TEMPLATE))
    with TestClient(app) as client:
        for body in hostile:
            reply = client.post(
                "/v1/completions",
                content=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            assert reply.status_code == 413, reply.text
            message = reply.json()["error"]["message"]
            assert message.startswith(f"the body holds more than {bound} JSON objects"), message
        reply = client.post("/v1/completions", json=inside)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"].startswith("max_tokens"), reply.text


def test_a_deadline_no_queue_could_meet_names_the_field_to_change():
    """OpenAI's param was null for deadline_unreachable (a tester): the request's own
    deadline_ms when it set one, else its token limit (the objective set the deadline)."""
    from gateway_svc.app import refused_param
    from gateway_svc.bodies import CompletionBody

    said = "request r cannot meet its deadline on d: ask for fewer tokens or a later deadline"
    code = "deadline_unreachable"
    own = CompletionBody(model="m", prompt="x", deadline_ms=5)
    assert refused_param(said, own, False, code) == "deadline_ms"
    assert refused_param(said, CompletionBody(model="m", prompt="x"), False, code) == "max_tokens"
    newer = CompletionBody(model="m", prompt="x", max_completion_tokens=9)
    assert refused_param(said, newer, False, code) == "max_completion_tokens"
    assert refused_param(said, own, False) is None  # another refusal that names no field


@pytest.mark.parametrize(
    ("error", "leaves", "outcome"),
    [(None, False, "completed"), ("gone", False, "failed"), (None, True, "cancelled")],
)
def test_a_stream_says_how_it_ended(error, leaves, outcome):
    """Its HTTP status was 200 before its first token: how it ended is told apart, for
    iserve_gateway_streams_total (a failed or abandoned stream was counted a plain 200)."""
    from gateway_svc.app import _Generation, _stream
    from gateway_svc.bodies import CompletionBody
    from services.api import inference_service_pb2 as inference_pb

    class Call:
        def __init__(self):
            self.replies = [inference_pb.GenerateResponse(delta=inference_pb.TokenDelta(text="a"))]

        async def read(self):
            if self.replies:
                return self.replies.pop(0)
            if error:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), error
                )
            return grpc.aio.EOF

        def cancel(self):
            pass

    told = []

    async def main():
        events = _stream(
            [_Generation(Call(), None)],
            CompletionBody(model="m", prompt="x", stream=True),
            "cmpl-1",
            0,
            False,
            False,
            ended=told.append,
        )
        seen = [await anext(events)]
        if leaves:
            await events.aclose()
        else:
            seen += [event async for event in events]
            assert seen[-1] == "[DONE]"

    asyncio.run(main())
    assert told == [outcome]
