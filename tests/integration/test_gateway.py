"""The OpenAI-compatible gateway against the live stack: the official ``openai`` client,
raw HTTP for the SSE framing, a disconnect cancelling the generation, error statuses."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from gateway_svc.app import MAX_BODY_BYTES, MAX_BODY_STRUCTURE
from gateway_svc.bodies import MAX_PROMPTS
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.models.checkpoint import create_checkpoint
from tests.conftest import QUEUE_CAPACITY
from tests.integration.helpers import (
    TINY,
    deploy,
    generate,
    make_checkpoint,
    register,
    rid,
    wait_for,
)

pytestmark = pytest.mark.integration

MODEL, PLAIN = "gw-llama", "gw-plain"
MAX_OUTPUT = 1500


@pytest.fixture(scope="module")
def gateway(stack):
    """The stack's gateway base URL, with MODEL (a chat template) and PLAIN (none) deployed."""
    register(stack, MODEL, make_checkpoint(stack, MODEL))
    create_checkpoint(stack.models_root / PLAIN, **TINY, chat_template=None, overwrite=True)
    register(stack, PLAIN, PLAIN)
    deployed = [
        deploy(stack, MODEL, max_output_tokens=MAX_OUTPUT, batch_size=1).deployment.deployment_id,
        deploy(stack, PLAIN).deployment.deployment_id,
    ]
    yield f"http://{stack.settings.gateway_address}"
    for deployment_id in deployed:
        _remove(stack, deployment_id)


def _post_raw(
    url: str, content, content_type: str = "application/json", timeout: float = 30
) -> httpx.Response:
    """POST ``content`` (bytes or an iterator of chunks) exactly as given."""
    return httpx.post(url, content=content, headers={"content-type": content_type}, timeout=timeout)


def _remove(stack, deployment_id: str) -> None:
    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(request_id=rid(), deployment_id=deployment_id),
        timeout=60,
    )


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="not-checked", max_retries=0)


def test_the_openai_client_streams_a_chat_and_a_completion_with_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens >= 1 and usage.prompt_tokens > 3  # the template's tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert isinstance(text, str)

    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=8,
            temperature=0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    whole = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0, seed=3
    )
    # Greedy: the same text streamed or not.
    assert whole.choices[0].text == "".join(c.choices[0].text for c in streamed if c.choices)
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 5


def test_every_response_has_an_x_request_id_the_completion_and_the_scheduler_log_carry(
    stack, client
):
    """OpenAI's header (its SDKs keep it as ``_request_id``) was missing: a client's report
    could not be matched to the services' log lines."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    request_id = raw.headers["x-request-id"]
    chat = raw.parse()
    assert chat.id == f"chatcmpl-{request_id}" and chat._request_id == request_id
    streamed = client.completions.with_raw_response.create(
        model=MODEL, prompt=["a", "b"], max_tokens=2, stream=True
    )
    other = streamed.headers["x-request-id"]
    assert other != request_id
    assert {chunk.id for chunk in streamed.parse()} == {f"cmpl-{other}"}
    log = stack.settings.state_dir / "logs" / "scheduler.log"
    assert wait_for(
        lambda: all(
            f"request {rid} served by" in log.read_text()
            for rid in (request_id, other, f"{other}-1")
        ),
        timeout=10,
    ), "the scheduler's log names no request by the ids the client was given"
    refused = httpx.get(f"{client.base_url}models/not-there", timeout=10)
    assert refused.status_code == 404 and len(refused.headers["x-request-id"]) == 32


def test_models_lists_what_is_deployed(client):
    ids = {m.id for m in client.models.list()}
    assert {MODEL, PLAIN} <= ids
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "iserve")
    assert model.created == next(m.created for m in client.models.list() if m.id == MODEL)
    for absent in ("nope", "meta-llama/Llama-3.1-8B"):
        with pytest.raises(openai.NotFoundError, match=absent):
            client.models.retrieve(absent)


def test_sse_framing_is_data_lines_ending_with_done(gateway):
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 6, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_text_before_it(client):
    whole = client.completions.create(model=MODEL, prompt="x y", max_tokens=24, temperature=0)
    text = whole.choices[0].text
    if len(text) < 4:
        pytest.skip(f"the random model's greedy text is too short to cut: {text!r}")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.completions.create(
        model=MODEL, prompt="x y", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # Usage counts what ran up to the stop (the worker ends the generation there).
    assert cut.usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert 1 <= cut.usage.completion_tokens < whole.usage.completion_tokens
    assert cut.usage.total_tokens == cut.usage.prompt_tokens + cut.usage.completion_tokens
    streamed = client.completions.create(
        model=MODEL,
        prompt="x y",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        stream=True,
        stream_options={"include_usage": True},
    )
    (usage,) = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == cut.usage.completion_tokens


def _running(stack) -> int:
    stats = stack.inference.GetServingStats(infer_pb.GetServingStatsRequest(), timeout=10)
    return sum(d.requests_running for d in stats.deployments if d.model_id == MODEL)


def test_a_client_that_disconnects_cancels_its_generation(stack, gateway):
    body = {"model": MODEL, "prompt": "go", "max_tokens": MAX_OUTPUT, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert _running(stack) == 1
    # Closed after the first event; 1500 tokens would take far longer than this.
    deadline = time.monotonic() + 5.0
    while _running(stack) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(stack) == 0


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


SLOW = "gw-slow"


@pytest.fixture(scope="module")
def slow(stack, gateway):
    """A model slow enough (hidden 512, 8 layers: milliseconds a token on this CPU) that a
    generation of MAX_OUTPUT tokens outlasts a client's patience; batch 1."""
    register(stack, SLOW, make_checkpoint(stack, SLOW, hidden_size=512, num_layers=8))
    deployed = deploy(stack, SLOW, max_output_tokens=MAX_OUTPUT, batch_size=1)
    yield SLOW
    _remove(stack, deployed.deployment.deployment_id)


def _slow_deployment(stack) -> infer_pb.DeploymentServingStats:
    """The slow model's serving stats; all zeros before the scheduler has routed to it."""
    stats = stack.inference.GetServingStats(infer_pb.GetServingStatsRequest(), timeout=10)
    mine = [d for d in stats.deployments if d.model_id == SLOW]
    assert len(mine) <= 1, mine
    return mine[0] if mine else infer_pb.DeploymentServingStats(model_id=SLOW)


def _slow_stats(stack) -> tuple[int, int]:
    """(waiting, running) of the slow model's deployment."""
    mine = _slow_deployment(stack)
    return mine.requests_waiting, mine.requests_running


def _slow_ended(stack) -> tuple[int, int]:
    """(completed, failed) requests of the slow model's deployment (a cancelled one
    failed)."""
    mine = _slow_deployment(stack)
    return mine.requests_completed, mine.requests_failed


def _send_and_leave(gateway: str, body: dict, until) -> None:
    """POST ``body`` to /v1/completions on a connection of its own and close it (the
    client goes) once ``until()`` holds: a fact on the scheduler, so the request has
    certainly reached it however slow the box. Nothing may have come back by then."""
    url = httpx.URL(gateway)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port), timeout=30) as conn:
        conn.sendall(head.encode() + payload)
        assert _until(until, 30.0), "the request did not reach the scheduler"
        conn.setblocking(False)
        try:
            early = conn.recv(65536)
        except BlockingIOError:
            early = None
        assert early is None, f"something was sent before the client left: {early!r}"


def test_a_client_that_disconnects_before_any_reply_cancels_its_request(stack, gateway, slow):
    """Not streamed, or streamed but still queued: nothing has been sent when the client
    goes, and the request is cancelled all the same (before, it ran to the end, or waited
    for a slot holding a queue place)."""
    long = {"model": slow, "prompt": "go", "max_tokens": MAX_OUTPUT, "ignore_eos": True}
    completed, failed = _slow_ended(stack)

    def ended() -> tuple[int, int]:
        now = _slow_ended(stack)
        return now[0] - completed, now[1] - failed

    # Generating (it holds the slot), not streamed: the client goes.
    _send_and_leave(gateway, long, lambda: _slow_stats(stack) == (0, 1))
    assert _until(lambda: _slow_stats(stack) == (0, 0), 15.0), "the generation went on"
    # Cancelled, not finished (on a fast machine it might have finished in the wait).
    assert ended() == (0, 1)

    # The deployment's one slot held by a stream; a second request waits in the queue.
    url = f"{gateway}/v1/completions"
    with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as held:
        lines = held.iter_lines()  # kept: a discarded iterator closes the stream
        next(line for line in lines if line.startswith("data: "))
        for stream in (True, False):
            _send_and_leave(
                gateway, {**long, "stream": stream}, lambda: _slow_stats(stack) == (1, 1)
            )
            assert _until(lambda: _slow_stats(stack) == (0, 1), 15.0), "it kept its place"
    assert _until(lambda: _slow_stats(stack) == (0, 0), 15.0)
    assert ended() == (0, 4)  # the held stream too, closed by its client


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "says"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "not_found_error", "nope"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "invalid_request_error", "n=1"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 9}, 400, "invalid_request_error", "temperature"),
        ("/v1/completions", {"model": MODEL}, 400, "invalid_request_error", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_OUTPUT + 1}, 400, "invalid_request_error", "max"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "invalid_request_error", "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error", "role"),
        ("/v1/chat/completions", {"model": PLAIN, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "chat_template"),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "not_found_error", "nope"),
        # Beyond the uint32 / uint64 fields they become (a 500 before).
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2**32}, 400, "invalid_request_error", "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**40}, 400, "invalid_request_error", "max_completion_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "invalid_request_error", "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "deadline_ms": 2**32}, 400, "invalid_request_error", "deadline_ms"),
        # What would be dropped or answered with null is refused instead.
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "invalid_request_error", "only text content parts"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "invalid_request_error", "a text content part needs its text as a string ({'type': 'text', 'text': ...}), got no text"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400, "invalid_request_error", "got text None"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "invalid_request_error", "log-probabilities"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "invalid_request_error", "log-probabilities"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "invalid_request_error", "log-probabilities"),
        ("/v1/completions", {"model": MODEL, "prompt": ["one"] * (MAX_PROMPTS + 1)}, 400, "invalid_request_error", f"at most {MAX_PROMPTS} prompts"),
        ("/v1/completions", {"model": MODEL, "prompt": ["one", ""]}, 400, "invalid_request_error", "the prompt is empty"),
        # Fields of a message's own holding a flood of values: refused before its render
        # (8 million empty objects ran the render process out of memory: a 500; a tester).
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "x": [{}] * 70_000}]}, 400, "invalid_request_error", "more than 65536 JSON values"),
        # A mix of the two list forms, which the OpenAPI document calls invalid (a tester).
        ("/v1/completions", {"model": MODEL, "prompt": ["a", [1, 2]]}, 400, "invalid_request_error", "prompt: a list of prompts holds texts or token id lists, not both"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], "a"]}, 400, "invalid_request_error", "prompt: a list of prompts holds texts or token id lists, not both"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "invalid_request_error", "token ids"),
        ("/v1/completions", {"model": MODEL, "prompt": [10**6], "max_tokens": 2}, 400, "invalid_request_error", "prompt_token_ids outside [0, 640)"),
        # Which prompt of a list is refused (a tester could not tell).
        ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [10**6]], "max_tokens": 2}, 400, "invalid_request_error", "prompt 1 (of 2, from 0): prompt_token_ids outside [0, 640)"),
        # Parameters whose effect the server does not have: ignored, they would change the
        # answer in silence.
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1.5}, 400, "invalid_request_error", "presence penalties are not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -0.5}, 400, "invalid_request_error", "frequency penalties are not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"7": 100}}, 400, "invalid_request_error", "logit biases are not supported"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, 400, "invalid_request_error", "response formats other than text"),
        # vLLM serves it on completions too (structured output): it was ignored there.
        ("/v1/completions", {"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, 400, "invalid_request_error", "response formats other than text"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "add_special_tokens": "no"}, 400, "invalid_request_error", "add_special_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "documents": [{"title": "t", "text": "x"}]}, 400, "invalid_request_error", "documents: documents are not supported"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "invalid_request_error", "tool calling is not supported"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, 400, "invalid_request_error", "modalities"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "invalid_request_error", "echo is not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "end"}, 400, "invalid_request_error", "suffixes are not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "invalid_request_error", "best_of other than 1"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 1.1}, 400, "invalid_request_error", "repetition_penalty: repetition penalties are not supported"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "guided_json": {"type": "object"}}, 400, "invalid_request_error", "guided_json: guided decoding is not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "skip_special_tokens": False}, 400, "invalid_request_error", "skip_special_tokens: special tokens in the output"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "invalid_request_error", "tool_choice: tool calling is not supported"),
        # OpenAI and vLLM answer 0 with the sampled token's log-probability.
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 0}, 400, "invalid_request_error", "logprobs: log-probabilities are not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "invalid_request_error", "top_k: Input should be greater than or equal to -1"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, 400, "invalid_request_error", "stop_token_ids: stop_token_ids takes token ids"),
        ("/v1/embeddings", {"model": MODEL, "input": "x"}, 404, "not_found_error", "Not Found: '/v1/embeddings' is not served here; the OpenAI endpoints served are POST /v1/chat/completions"),
    ],
)  # fmt: skip
def test_errors_have_openais_body_and_the_status_of_their_cause(
    gateway, path, body, status, kind, says
):
    for stream in (False, True):
        reply = httpx.post(f"{gateway}{path}", json={**body, "stream": stream}, timeout=60)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        # OpenAI's code: a string for what a client acts on (a model it does not have),
        # null for the rest; it was the HTTP status, a number, where the SDKs type a string.
        code = "model_not_found" if body.get("model") == "nope" else None
        assert error["type"] == kind and error["code"] == code, error
        assert says in error["message"], error


@pytest.mark.parametrize(
    ("content", "content_type", "says"),
    [
        (b"{not json", "application/json", "the body is not valid JSON (at character 1"),
        # What Python's parser meets, named (FastAPI said "There was an error parsing the body").
        (b'{"stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", "the body is not valid JSON (RecursionError"),
        (b'{"max_tokens": ' + b"9" * 100_000 + b"}", "application/json", "the body is not valid JSON (ValueError: Exceeds the limit"),
        ('{"prompt": "caf\xe9"}'.encode("latin-1"), "application/json", "the body is not valid JSON (UnicodeDecodeError"),
        # A body that is not an object (the message had an empty field name before).
        (b"[1, 2]", "application/json", "the body must be a JSON object"),
        (b"", "application/json", "the body is empty"),
        # A JSON object sent as text, or as a form (curl -d's default): the header is what
        # is wrong (a probe was told the body was no JSON object), a 415.
        (b'{"model": "x", "prompt": "y"}', "text/plain", "the body was sent with content-type 'text/plain': send it as application/json"),
        (b'{"model": "x", "prompt": "y"}', "application/x-www-form-urlencoded", "the body was sent with content-type 'application/x-www-form-urlencoded'"),
        # Not read as JSON either, though it says json (a tester was told the object was none).
        (b'{"model": "x", "prompt": "y"}', "text/json; charset=utf-8", "the body was sent with content-type 'text/json': send it as application/json"),
    ],
)  # fmt: skip
def test_a_body_that_is_not_a_json_object_is_a_400_saying_why(gateway, content, content_type, says):
    reply = _post_raw(f"{gateway}/v1/completions", content, content_type=content_type, timeout=30)
    status = 400 if content_type == "application/json" else 415
    assert reply.status_code == status and reply.json()["error"]["type"] == "invalid_request_error"
    error = reply.json()["error"]
    assert error["message"].startswith(says), error
    assert error["param"] is None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}',
        ),
    ],
)
def test_a_lone_surrogate_is_a_400(gateway, path, body):
    for stream in (b"false", b"true"):
        content = body.replace(b"%s", MODEL.encode())[:-1] + b', "stream": ' + stream + b"}"
        reply = _post_raw(f"{gateway}{path}", content, timeout=30)
        assert reply.status_code == 400, reply.text
        assert "not valid Unicode" in reply.json()["error"]["message"]


def test_text_parts_and_declined_logprobs_are_served(client):
    # Text content parts are joined; logprobs false (as many clients send) is no request,
    # nor are the neutral values of the parameters the server does not have.
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        max_tokens=2,
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        response_format={"type": "text"},
        tools=[],
        modalities=["text"],
        user="someone",
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    reply = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=2,
        echo=False,
        best_of=1,
        suffix="",
        extra_body={"response_format": {"type": "text"}},
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_stream_options_without_a_stream_is_a_400(gateway):
    body = {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}
    for stream in ({}, {"stream": False}):
        reply = httpx.post(f"{gateway}/v1/completions", json={**body, **stream}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "stream_options"
        assert error["message"].endswith("stream_options is only allowed when stream is true")


def test_with_include_usage_every_chunk_carries_usage_null_until_the_last(gateway):
    """OpenAI's stream: with include_usage each chunk has a "usage" key, null but on the
    last (choices empty); a client reading chunk["usage"] got a KeyError here."""
    for path, extra in (("completions", {"prompt": "x"}), ("chat/completions", {})):
        # Greedy, to the end: a sampled EOS, or sampled byte tokens whose text comes out
        # together, left fewer chunks now and then.
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {"messages": [{"role": "user", "content": "hi"}]}),
        }
        with httpx.stream("POST", f"{gateway}/v1/{path}", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            data = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert len(chunks) >= 3 and all("usage" in c for c in chunks), (path, chunks)
        assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        # Without include_usage no chunk has the key (OpenAI's form).
        body.pop("stream_options")
        with httpx.stream("POST", f"{gateway}/v1/{path}", json=body, timeout=60) as reply:
            data = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert not any("usage" in json.loads(d) for d in data[:-1])


def test_a_deployment_id_given_as_model_is_served_by_that_deployment(stack, gateway):
    """`model` is HTTP's only field for what serves a request: a deployment's id there
    pins it to that deployment (of a model deployed twice, each compressed otherwise,
    either answered, and a deployment's id was refused: "ask for that model")."""
    listed = stack.deployments.ListDeployments(
        deploy_pb.ListDeploymentsRequest(model_id=MODEL), timeout=10
    ).deployments
    named = listed[0].deployment_id
    for path, extra in (
        ("completions", {"prompt": "x"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True, **extra}
        reply = httpx.post(f"{gateway}/v1/{path}", json={"model": named, **body}, timeout=60)
        assert reply.status_code == 200, (path, reply.text)
        answer = reply.json()
        assert answer["model"] == named and answer["usage"]["completion_tokens"] == 2
        same = httpx.post(f"{gateway}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
        assert same.json()["choices"] == answer["choices"], path  # the one deployment
        gone = f"{MODEL}-00000000"
        reply = httpx.post(f"{gateway}/v1/{path}", json={"model": gone, **body}, timeout=60)
        assert reply.status_code == 404, reply.text
        # Not "has no deployment" alone, which reads as a model's: it is no deployment's.
        assert reply.json()["error"]["message"] == (
            f"model {gone} has no deployment, and no deployment has that id"
        ), reply.text
    # OpenAI's retrieve answers for what `model` may name: the deployment, its model the
    # parent (a 404 before); the list names each model once.
    retrieved = httpx.get(f"{gateway}/v1/models/{named}", timeout=10)
    assert retrieved.status_code == 200, retrieved.text
    assert retrieved.json() == {
        "id": named,
        "object": "model",
        "created": listed[0].created_at_unix_ms // 1000,
        "owned_by": "iserve",
        "parent": MODEL,
    }
    assert named not in {
        m["id"] for m in httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"]
    }
    assert httpx.get(f"{gateway}/v1/models/{MODEL}-00000000", timeout=10).status_code == 404


def test_vllms_top_k_and_stop_token_ids_steer_the_generation(stack, client):
    # Accepted and dropped before: top_k 1 sampled at temperature 1.5, and a stop token
    # id ended nothing.
    prompt, tokens = "The quick brown fox", 12
    run = {"model": MODEL, "prompt": prompt, "max_tokens": tokens}
    greedy = client.completions.create(**run, temperature=0, extra_body={"ignore_eos": True})
    hot = {**run, "temperature": 1.5, "seed": 5}
    sampled = client.completions.create(**hot, extra_body={"ignore_eos": True})
    assert sampled.choices[0].text != greedy.choices[0].text  # else top_k 1 shows nothing
    top1 = client.completions.create(**hot, extra_body={"ignore_eos": True, "top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text

    # The greedy run's token ids; the first that does not repeat an earlier one, past
    # the second, is where a stop on its id ends the same run.
    deltas, _ = generate(
        stack,
        model_id=MODEL,
        prompt=prompt,
        max_tokens=tokens,
        sampling=common.SamplingParams(ignore_eos=True),
    )
    ids = [t for delta in deltas for t in delta.token_ids]
    assert len(ids) == tokens
    at = next(i for i in range(2, tokens) if ids[i] not in ids[:i])
    cut = client.completions.create(
        **run, temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [ids[at]]}
    )
    before = client.completions.create(
        **{**run, "max_tokens": at}, temperature=0, extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == before.choices[0].text  # the stop token's text left out
    assert cut.usage.completion_tokens == at + 1
    # An id outside the vocabulary (640 tokens) is never sampled, so it stops nothing.
    beyond = client.completions.create(
        **run, temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [10**6]}
    )
    assert beyond.choices[0].finish_reason == "length"
    assert beyond.choices[0].text == greedy.choices[0].text


def test_health_and_metrics(gateway):
    assert httpx.get(f"{gateway}/health", timeout=10).json() == {"status": "ok"}
    metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
    assert "iserve_gateway_requests_total" in metrics


def test_a_stream_is_timed_to_its_last_byte(gateway):
    """iserve_gateway_request_seconds stopped a stream's clock at its first byte (a
    tester): its sum grew by a few milliseconds for a stream that took most of a second."""

    def summed(client: httpx.Client) -> float:
        metrics = client.get("/metrics").text
        prefix = 'iserve_gateway_request_seconds_sum{endpoint="/v1/completions"}'
        return sum(
            float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix)
        )

    body = {"model": MODEL, "prompt": "timed", "max_tokens": 400, "stream": True}
    with httpx.Client(base_url=gateway, timeout=120) as client:
        before = summed(client)
        started = time.perf_counter()
        with client.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as reply:
            assert reply.status_code == 200
            chunks = [line for line in reply.iter_lines() if line.startswith("data: ")]
        elapsed = time.perf_counter() - started
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 100
        timed = summed(client) - before
    # Timed by the server from the request's arrival to the stream's end: most of what the
    # client waited (the request's way in and the last chunk's way out aside; the
    # first byte alone is a few per cent of it).
    assert 0.5 * elapsed <= timed <= elapsed, (timed, elapsed)


def test_a_stream_s_end_is_counted_as_it_ended(gateway):
    """A stream's HTTP status is 200 before its first token: one its client left, or that
    ended in an error event, was counted a 200 like any other (a tester). How each
    ended is counted on its own."""

    def ended(client: httpx.Client, outcome: str) -> float:
        metrics = client.get("/metrics").text
        line = f'iserve_gateway_streams_total{{endpoint="/v1/completions",outcome="{outcome}"}}'
        return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))

    body = {"model": MODEL, "prompt": "ends", "stream": True}
    with httpx.Client(base_url=gateway, timeout=120) as client:
        completed, cancelled = ended(client, "completed"), ended(client, "cancelled")
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 3}) as reply:
            assert "data: [DONE]" in list(reply.iter_lines())
        assert wait_for(lambda: ended(client, "completed") == completed + 1, timeout=10)
        long = {**body, "max_tokens": 400, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json=long) as reply:
            assert reply.status_code == 200
            next(line for line in reply.iter_lines() if line.startswith("data: "))
        # Closed after its first event: the client left.
        assert wait_for(lambda: ended(client, "cancelled") == cancelled + 1, timeout=30)
        assert ended(client, "completed") == completed + 1


def test_metrics_count_routes_not_the_paths_asked_for(gateway):
    # /metrics is open: a series per path sent named every model id asked for, and
    # grew without bound (3,000 requests made it 17 MB).
    with httpx.Client(base_url=gateway, timeout=30) as client:

        def series() -> set[str]:
            text = client.get("/metrics").text
            assert "secret-model" not in text and "/probe" not in text
            return {line.split(" ")[0] for line in text.splitlines() if "endpoint=" in line}

        def ask(first: int, count: int) -> None:
            for i in range(first, first + count):
                assert client.get(f"/v1/models/secret-model-{i}").status_code == 404
                assert client.get(f"/probe/{i}/{'x' * 200}").status_code == 404

        ask(0, 2)
        settled = series()
        ask(2, 300)
        assert series() == settled
    assert 'iserve_gateway_requests_total{endpoint="/v1/models/{model_id}",status="404"}' in settled
    assert 'iserve_gateway_requests_total{endpoint="unmatched",status="404"}' in settled


def test_with_authentication_off_a_header_that_cannot_be_a_token_is_ignored(gateway):
    # Non-ASCII was a 500 (gRPC metadata is ASCII) and 60 KB a 429 (the services'
    # metadata limit); with nothing checked they are served as no token is.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for header in (b"Bearer \xe9" + b"a" * 40, b"Bearer " + b"a" * 60_000):
        listed = httpx.get(f"{gateway}/v1/models", headers=[(b"authorization", header)], timeout=30)
        assert listed.status_code == 200, listed.text
        served = httpx.post(
            f"{gateway}/v1/completions", json=body, headers=[(b"authorization", header)], timeout=60
        )
        assert served.status_code == 200, served.text


def test_a_long_header_that_arrives_in_pieces_is_served_as_one_that_arrives_at_once(gateway):
    """h11 bounds a request head only while it is incomplete (16 KiB by default): the
    60 KB header above was served when it came in one read and the connection reset
    when TCP split it (the fresh-clone CI, once). Sent 1 KB at a time, it is served."""
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    head = (
        f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
        + "a" * 60_000
        + "\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        for start in range(0, len(head), 1024):
            conn.sendall(head[start : start + 1024])
            time.sleep(0.001)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def _hold(gateway: str, model: str, stop: threading.Event, started: list[int]) -> None:
    """A long streamed completion, read until ``stop`` (then the connection closes)."""
    body = {"model": model, "prompt": "hold", "max_tokens": MAX_OUTPUT, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=120) as reply:
        started.append(reply.status_code)
        for _ in reply.iter_lines():
            if stop.is_set():
                return


def test_a_full_queue_is_429(stack, gateway, slow):
    """Batch 1 and room for QUEUE_CAPACITY waiting: one more is refused at once."""
    stop, started = threading.Event(), []
    # The slow model: its generations outlast the test, so the slot stays held and the
    # queue full until the probe has its answer.
    holders = [
        threading.Thread(target=_hold, args=(gateway, slow, stop, started), daemon=True)
        for _ in range(1 + QUEUE_CAPACITY)
    ]
    try:
        holders[0].start()
        assert wait_for(lambda: _slow_stats(stack) == (0, 1), timeout=60), _slow_stats(stack)
        for holder in holders[1:]:
            holder.start()
        # Full, as the scheduler counts it, before the probe is sent.
        full = (QUEUE_CAPACITY, 1)
        assert wait_for(lambda: _slow_stats(stack) == full, timeout=60), _slow_stats(stack)
        reply = httpx.post(
            f"{gateway}/v1/completions", json={"model": slow, "prompt": "x"}, timeout=30
        )
        assert reply.status_code == 429, reply.text
        assert reply.json()["error"]["type"] == "rate_limit_error"
        assert "full" in reply.json()["error"]["message"]
    finally:
        stop.set()
        for holder in holders:
            holder.join(timeout=60)
    assert started == [200] * len(holders)


def test_a_deadline_edf_cannot_meet_is_504_and_one_no_queue_could_meet_400(stack, gateway):
    register(stack, "gw-edf", make_checkpoint(stack, "gw-edf"))
    dep = deploy(
        stack,
        "gw-edf",
        batch_size=1,
        max_output_tokens=600,
        objectives=common.ServiceObjectives(scheduling=common.SCHEDULING_POLICY_EDF),
    ).deployment
    try:
        warm = {"model": "gw-edf", "prompt": "warm up", "max_tokens": 20}
        assert httpx.post(f"{gateway}/v1/completions", json=warm, timeout=60).status_code == 200
        # Its prefill alone passes the deadline: late now (the OpenAI SDKs retry a 504).
        late = {"model": "gw-edf", "prompt": "x " * 200, "max_tokens": 1, "deadline_ms": 1}
        reply = httpx.post(f"{gateway}/v1/completions", json=late, timeout=60)
        assert reply.status_code == 504, reply.text
        assert reply.json()["error"]["type"] == "timeout_error"
        # The decode of its max_tokens alone does: the request is to change, not retried.
        hopeless = {"model": "gw-edf", "prompt": "x", "max_tokens": 500, "deadline_ms": 1}
        reply = httpx.post(f"{gateway}/v1/completions", json=hopeless, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "deadline_unreachable")
        assert "ask for fewer tokens or a later deadline" in error["message"]
        assert error["param"] == "deadline_ms"  # null before (a tester)
    finally:
        _remove(stack, dep.deployment_id)


def test_a_worker_that_dies_mid_request_is_503(stack, gateway):
    # Wide enough that 1,500 tokens take seconds, not a blink.
    shape = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}
    register(stack, "gw-doomed", make_checkpoint(stack, "gw-doomed", **shape))
    dep = deploy(stack, "gw-doomed", max_output_tokens=MAX_OUTPUT).deployment
    try:
        [worker] = stack.agent.ListWorkers(
            agent_pb.ListWorkersRequest(request_id=rid(), deployment_id=dep.deployment_id)
        ).workers
        body = {"model": "gw-doomed", "prompt": "x", "max_tokens": MAX_OUTPUT, "ignore_eos": True}
        result: list[httpx.Response] = []
        caller = threading.Thread(
            target=lambda: result.append(
                httpx.post(f"{gateway}/v1/completions", json=body, timeout=120)
            )
        )
        caller.start()
        time.sleep(1.5)  # generating: 1,500 tokens of this model take about 7 s here
        assert caller.is_alive() and not result
        os.kill(worker.pid, signal.SIGKILL)
        caller.join(timeout=60)
        [reply] = result
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["type"] == "service_unavailable_error"
    finally:
        _remove(stack, dep.deployment_id)


def test_a_completion_prompt_may_be_token_ids_or_a_list_of_one_prompt(stack, gateway):
    # OpenAI's prompt forms (lm-eval-harness sends token ids): the same greedy tokens
    # whichever form carries the same prompt.
    text = "The quick brown fox"
    ids = Tokenizer.from_file(str(stack.models_root / MODEL / "tokenizer.json")).encode(text).ids
    replies = []
    for prompt in (text, [text], ids, [ids]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        reply = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        replies.append(reply.json())
    assert len({r["choices"][0]["text"] for r in replies}) == 1
    assert {r["usage"]["prompt_tokens"] for r in replies} == {len(ids)}


def test_a_template_file_linked_outside_the_models_root_is_not_read(stack, gateway, tmp_path):
    """A checkpoint's chat_template.jinja made a link to a file outside the models root
    after registration: the gateway rendered that file (the stack's service token, its
    own environment with Redis's password) into the prompt (a probe). Now a 500 (the
    model's files, not the request: registration refuses such a link) that says why, and
    the file's text is nowhere in the reply."""
    secret = tmp_path / "service-token"
    secret.write_text("not-a-template-but-a-secret")
    link = stack.models_root / PLAIN / "chat_template.jinja"
    link.symlink_to(secret)
    try:
        body = {"model": PLAIN, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        reply = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    finally:
        link.unlink()
    assert reply.status_code == 500, reply.text
    assert "links outside the models root" in reply.json()["error"]["message"]
    assert "secret" not in reply.text


def test_add_special_tokens_is_served_as_vllm_serves_it(stack, gateway):
    # vLLM's add_special_tokens: on by default for a completion's text (the tokenizer's
    # BOS), off for a chat (its template writes the BOS); either way round when asked.
    # It was dropped in silence on completions.
    tokenizer = Tokenizer.from_file(str(stack.models_root / MODEL / "tokenizer.json"))
    text = "The quick brown fox"
    plain = len(tokenizer.encode(text, add_special_tokens=False).ids)
    assert len(tokenizer.encode(text).ids) == plain + 1  # the checkpoint's BOS

    def prompt_tokens(path: str, body: dict) -> int:
        reply = httpx.post(
            f"{gateway}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    completion = {"prompt": text}
    assert prompt_tokens("completions", completion) == plain + 1
    assert prompt_tokens("completions", {**completion, "add_special_tokens": None}) == plain + 1
    assert prompt_tokens("completions", {**completion, "add_special_tokens": False}) == plain
    chat = {"messages": [{"role": "user", "content": text}]}
    templated = prompt_tokens("chat/completions", chat)
    assert prompt_tokens("chat/completions", {**chat, "add_special_tokens": True}) == templated + 1


def test_several_prompts_get_a_choice_each_as_their_own_completions(client, stack):
    # OpenAI's list of prompts (LangChain's legacy LLM batches them): a choice per
    # prompt, index its place, each what that prompt alone gets; the usage adds up.
    prompts = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    together = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(together.usage, key) == sum(getattr(a.usage, key) for a in alone)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompts,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {i: "" for i in range(len(prompts))}
    ends = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [a.choices[0].text for a in alone]
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 18

    # One prompt refused refuses the request, and leaves nothing running.
    too_long = [1] * 2100  # beyond the sequence (and the 2048-position context)
    with pytest.raises(openai.BadRequestError, match="prompt has"):
        client.completions.create(model=MODEL, prompt=[[5, 6, 7], too_long], max_tokens=2)
    assert _until(lambda: _running(stack) == 0)


def test_a_body_above_the_limit_is_a_413_whether_its_length_is_given_or_not(gateway):
    # Refused before it is read whole: no body of gigabytes is parsed into memory.
    big = json.dumps({"model": MODEL, "prompt": "a" * (MAX_BODY_BYTES + 1)}).encode()

    def chunks():
        for start in range(0, len(big), 2**20):
            yield big[start : start + 2**20]

    for content in (big, chunks()):
        reply = _post_raw(f"{gateway}/v1/completions", content, timeout=60)
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["message"] == f"the body is larger than {MAX_BODY_BYTES} bytes"
    # A body in chunks under the limit is served.
    body = json.dumps({"model": MODEL, "prompt": "a b", "max_tokens": 2}).encode()
    reply = _post_raw(f"{gateway}/v1/completions", iter([body[:7], body[7:]]), timeout=60)
    assert reply.status_code == 200, reply.text


def test_a_body_of_more_keys_than_the_structure_bound_is_a_413_in_chunks_or_not(gateway):
    # 2.4 million keys in 30 MB held the gateway's event loop 2 s in JSON parsing (a
    # tester): counted once read, and refused before the parse.
    keys = b",".join(b'"k%d": 0' % i for i in range(MAX_BODY_STRUCTURE))
    body = b'{"model": "%s", "prompt": "a b", "max_tokens": 2, %s}' % (MODEL.encode(), keys)
    pieces = [body[start : start + 2**20] for start in range(0, len(body), 2**20)]
    for content in (body, iter(pieces)):
        reply = _post_raw(f"{gateway}/v1/completions", content, timeout=60)
        assert reply.status_code == 413, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith(f"the body holds more than {MAX_BODY_STRUCTURE} JSON"), message
    # Half as many keys are parsed and served (keys OpenAI does not know are ignored).
    half = b",".join(b'"k%d": 0' % i for i in range(MAX_BODY_STRUCTURE // 2))
    body = b'{"model": "%s", "prompt": "a b", "max_tokens": 2, %s}' % (MODEL.encode(), half)
    reply = _post_raw(f"{gateway}/v1/completions", body, timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_a_sampling_number_that_is_not_finite_is_named_so(gateway, number):
    # Python's JSON reads NaN and Infinity; "less than or equal to 2" was the message.
    for field in (b"temperature", b"top_p"):
        body = b'{"model": "%s", "prompt": "x", "%s": %s}' % (MODEL.encode(), field, number)
        reply = _post_raw(f"{gateway}/v1/completions", body, timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["message"] == f"{field.decode()}: Input should be a finite number", error


def test_openais_top_p_zero_and_negative_seeds_are_served(client):
    # OpenAI takes top_p in [0, 1] (0: only the likeliest token, greedy) and an int64
    # seed; both were 400s.
    greedy = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0
    )
    top0 = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=1.0, top_p=0
    )
    assert top0.choices[0].text == greedy.choices[0].text
    seeded = [
        client.completions.create(
            model=MODEL, prompt="Once", max_tokens=8, temperature=1.0, seed=seed
        )
        .choices[0]
        .text
        for seed in (-1, -1, 2**64 - 1)
    ]
    assert seeded[0] == seeded[1] == seeded[2]  # -1 is 2^64 - 1's bit pattern
