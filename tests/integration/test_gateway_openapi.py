"""The gateway's OpenAPI document against the live gateway, checked by schemathesis: it
generates requests from the document (valid ones, and invalid ones) and checks each reply
against it.

- Requests for a model that is not deployed: every body the document calls valid gets
  the 404 of an unknown model, never a 400, and every body it calls invalid gets a 4xx.
  A 400 for a valid body would mean the document promises more than the gateway takes.
- Requests for a deployed model (a tiny one, whose context bounds every generation):
  no 5xx, and every status, content type and body is one the document declares.
"""

from __future__ import annotations

import re

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.api import common_pb2 as common
from services.api import inference_service_pb2 as infer_pb
from services.models.checkpoint import create_checkpoint
from services.proto_limits import UINT64_MAX
from tests.integration.helpers import TINY, deploy, register, rid

pytestmark = pytest.mark.integration

MODEL, ABSENT = "openapi-llama", "openapi-absent"
CONTEXT = 96  # positions: no generation the fuzzer asks for runs longer than this
MAX_OUTPUT = 32  # the deployer's default share of CONTEXT for output

CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


@pytest.fixture(scope="module")
def gateway_url(stack) -> str:
    create_checkpoint(
        stack.models_root / MODEL, **TINY, max_position_embeddings=CONTEXT, overwrite=True
    )
    register(stack, MODEL, MODEL)
    assert deploy(stack, MODEL).deployment.max_output_tokens == MAX_OUTPUT
    return f"http://{stack.settings.gateway_address}"


@pytest.fixture(scope="module")
def operations(gateway_url) -> dict[str, schemathesis.APIOperation]:
    document = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    found = {}
    for result in document.get_all_operations():
        operation = result.ok()
        found[f"{operation.method.upper()} {operation.path}"] = operation
    return found


def _fuzz(operation, mode: GenerationMode, model: str, check) -> None:
    """Runs ``check(case)`` on the cases hypothesis draws for the operation (schemathesis's
    strategy, driven here: its pytest plugin predates this pytest)."""

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        check(case)

    run()


POSTS = ["POST /v1/completions", "POST /v1/chat/completions"]


@pytest.mark.parametrize("label", POSTS)
def test_a_body_the_document_calls_valid_is_taken_and_an_invalid_one_refused(
    operations, gateway_url, label
):
    def valid(case) -> None:
        # The generator compares integers beyond 2^53 as floats, so it draws seeds up to
        # ~400 above the documented maximum 2^64-1 as valid ones; the gateway rightly
        # refuses those.
        seed = case.body.get("seed") if isinstance(case.body, dict) else None
        assume(not (isinstance(seed, int) and seed > UINT64_MAX))
        reply = case.call(base_url=gateway_url, timeout=30)
        case.validate_response(reply, checks=[positive_data_acceptance, *CONFORMANCE])
        assert reply.status_code == 404, reply.text  # the model, not the body, is refused

    def invalid(case) -> None:
        reply = case.call(base_url=gateway_url, timeout=30)
        case.validate_response(reply, checks=[negative_data_rejection, *CONFORMANCE])

    _fuzz(operations[label], GenerationMode.POSITIVE, ABSENT, valid)
    _fuzz(operations[label], GenerationMode.NEGATIVE, ABSENT, invalid)


@pytest.mark.parametrize(
    "label", [*POSTS, "GET /v1/models", "GET /v1/models/{model_id}", "GET /health", "GET /metrics"]
)
def test_every_reply_of_a_deployed_model_is_what_the_document_declares(
    operations, gateway_url, label
):
    def conforms(case) -> None:
        reply = case.call(base_url=gateway_url, timeout=60)
        case.validate_response(reply, checks=CONFORMANCE)

    _fuzz(operations[label], GenerationMode.POSITIVE, MODEL, conforms)


def test_without_max_tokens_a_chat_runs_to_the_limit_and_a_completion_to_16(gateway_url):
    # OpenAI's defaults: a chat generates up to the model's limit (here the deployment's
    # max_output_tokens), a completion 16 tokens, whether max_tokens is absent or null.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    completion = {"model": MODEL, "prompt": "once", "ignore_eos": True}
    for body, tokens in [
        (chat, MAX_OUTPUT),
        ({**chat, "max_tokens": None, "max_completion_tokens": None}, MAX_OUTPUT),
        (completion, 16),
        ({**completion, "max_tokens": None}, 16),
    ]:
        reply = httpx.post(
            f"{gateway_url}/v1/chat/completions"
            if "messages" in body
            else f"{gateway_url}/v1/completions",
            json=body,
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == tokens, body
        assert reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/v1/completions", "POST"),
        ("PUT", "/v1/models", "GET, HEAD"),
        ("POST", "/health", "GET, HEAD"),
        ("HEAD", "/v1/completions", "POST"),
    ],
)
def test_a_method_a_path_does_not_take_is_a_405_naming_those_it_does(
    gateway_url, method, path, allowed
):
    reply = httpx.request(method, f"{gateway_url}{path}", timeout=30)
    assert reply.status_code == 405
    assert reply.headers["allow"] == allowed  # RFC 9110 requires it
    if method != "HEAD":  # a HEAD's reply has no body
        assert reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}", "/health", "/metrics"])
def test_head_is_served_where_get_is_without_a_body(gateway_url, path):
    # HTTP requires HEAD wherever GET is taken (RFC 9110); it was a 405 (a tester).
    got = httpx.get(f"{gateway_url}{path}", timeout=30)
    head = httpx.head(f"{gateway_url}{path}", timeout=30)
    assert (head.status_code, got.status_code) == (200, 200), head.text
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_without_max_tokens_a_long_chat_gets_what_the_sequence_leaves(gateway_url):
    # A prompt longer than the deployment's max_input_tokens (CONTEXT - MAX_OUTPUT) is
    # served up to the context, as OpenAI's API serves a chat without max_tokens; with
    # max_tokens given, OpenAI's rule: prompt + max_tokens within the context (the
    # worker, which encodes it, says how many tokens it has).
    def chat(words: int, **fields) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "river " * words}],
            "ignore_eos": True,
            **fields,
        }
        return httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=60)

    def prompt_tokens(words: int) -> int:
        reply = chat(words, max_tokens=MAX_OUTPUT)
        if reply.status_code == 200:
            return reply.json()["usage"]["prompt_tokens"]
        message = reply.json()["error"]["message"]
        assert reply.status_code == 400 and "accepts at most" in message, message
        # OpenAI's code, which clients key their fallbacks on (the worker's refusal).
        assert reply.json()["error"]["code"] == "context_length_exceeded"
        return int(re.search(r"prompt has (\d+) tokens", message).group(1))

    words = next(w for w in range(10, CONTEXT) if prompt_tokens(w) > CONTEXT - MAX_OUTPUT + 8)
    prompt = prompt_tokens(words)
    assert prompt < CONTEXT
    reply = chat(words)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == CONTEXT - prompt
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    fits = chat(words, max_tokens=CONTEXT - prompt)
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["completion_tokens"] == CONTEXT - prompt
    refused = chat(words, max_tokens=CONTEXT - prompt + 1)
    assert refused.status_code == 400
    assert f"accepts at most {prompt - 1}" in refused.json()["error"]["message"]
    # The field a service's refusal is about is OpenAI's param (it was null).
    assert refused.json()["error"]["param"] == "messages"
    over = chat(1, max_completion_tokens=MAX_OUTPUT + 1)
    assert over.status_code == 400 and "exceeds max_output_tokens" in over.text, over.text
    assert over.json()["error"]["param"] == "max_completion_tokens"
    # The scheduler's message names its own field; the client sent the other.
    assert over.json()["error"]["message"].startswith("max_completion_tokens "), over.text


def test_without_max_tokens_a_long_token_id_prompt_gets_what_the_sequence_leaves(
    stack, gateway_url
):
    # The same over gRPC with token ids, which the scheduler counts itself.
    def generate(max_tokens: int):
        replies = stack.inference.Generate(
            infer_pb.GenerateRequest(
                request_id=rid(),
                model_id=MODEL,
                prompt_token_ids=[7] * 80,
                max_tokens=max_tokens,
                sampling=common.SamplingParams(ignore_eos=True),
            ),
            timeout=60,
        )
        return [r for r in replies if r.HasField("final")][-1].final

    assert generate(0).usage.completion_tokens == CONTEXT - 80
    with pytest.raises(grpc.RpcError) as refused:
        generate(MAX_OUTPUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
