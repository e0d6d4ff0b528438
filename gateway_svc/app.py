"""The OpenAI-compatible HTTP API, translated to iserve's gRPC services.

``POST /v1/completions`` and ``POST /v1/chat/completions`` become one
``InferenceService.Generate`` call each (the scheduler picks the deployment, queues and
streams: the gateway schedules nothing of its own); ``GET /v1/models`` lists the models
with a ready deployment; ``GET /health`` (the process answers), ``GET /ready`` (the
services behind it answer too) and ``GET /metrics`` (Prometheus text) serve operators.
FastAPI parses and validates the bodies, ``sse-starlette`` frames the streams
(``data: {json}`` events, ``data: [DONE]`` last); when a streaming client disconnects, the
gRPC call is cancelled and with it the worker's generation.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with the
status of the gRPC code (:func:`http_status`): unknown model 404, bad parameters 400
(and a deadline the decode of max_tokens alone would pass), queue full 429, deadline
missed 504, worker gone or service down 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import grpc
import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import (
    BaseModel,
)
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from gateway_svc.bodies import (
    COMPLETION_MAX_TOKENS,
    ChatBody,
    ChatMessage,
    CompletionBody,
    GenerationBody,
    StreamOptions,
)
from gateway_svc.chat import (
    BrokenChatTemplate,
    ChatTemplateError,
    NoChatTemplate,
    UnreadableChatTemplate,
    read_template,
)
from gateway_svc.render_pool import RenderPool
from services import transport
from services.aio import cancel_and_wait
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import (
    deployment_service_pb2_grpc,
    inference_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import inference_service_pb2 as inference_pb
from services.api import model_service_pb2 as model_pb
from services.auth.policy import GENERATE, role_name, roles_for
from services.auth.refusals import RefusalLog
from services.auth.tokens import bearer, could_be_token
from services.drain import refused_as_draining
from services.errors import (
    DeadlineUnreachable,
    InvalidArgument,
    NotServing,
    cut_off_midway,
    rpc_reason,
    shown,
    unreached,
)
from services.health import serving_status
from services.ids import check_model_id, looks_like_deployment_id, no_deployment
from services.metrics import certificate_expiry, new_registry
from services.settings import (
    DEFAULT_DRAIN_TIMEOUT_S,
    MAX_TOKEN_LENGTH,
    MIN_TOKEN_LENGTH,
    TlsFiles,
)

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
}
_FINISH = {
    common.FINISH_REASON_LENGTH: "length",
    common.FINISH_REASON_STOP: "stop",
    common.FINISH_REASON_CANCELLED: "stop",
}


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status code (500 for the rest)."""
    return _STATUS.get(code, (500, "internal_error"))


# OpenAI's error codes for what iserve can tell apart by status alone; others come from
# the services' error reason (services.errors.REASON_KEY), or are null.
_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}
# Seconds a client is told to wait before retrying a refusal that passes (a full queue, a
# service restarting): the OpenAI SDKs honour Retry-After and back off blindly without it.
RETRY_AFTER_S = 1
# The services the gateway calls, in the order of Backend.channels.
BACKEND_SERVICES = ("scheduler", "deploy", "model")


# The roles whose tokens /v1/models answers: those that may read deployments and
# generate on them.
_LISTERS = ", ".join(
    sorted(
        role_name(role)
        for role in (
            roles_for(
                f"/{deploy_pb.DESCRIPTOR.services_by_name['DeploymentService'].full_name}"
                "/ListDeployments"
            )
            or frozenset()
        )
        & (roles_for(GENERATE) or frozenset())
    )
)


def openai_code(status: int, param: str | None = None, reason: str = "") -> str | None:
    """OpenAI's ``error.code`` (a string or null): the services' reason when they gave
    one (``context_length_exceeded``, ``model_not_found``), ``model_not_found`` for a
    404 about the model, else by status."""
    if reason:
        return reason
    if status == 404 and param == "model":
        return "model_not_found"
    return _CODES.get(status)


def openai_error(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: what every error of the gateway answers, a response's body
    or a stream's error event."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    kind: str,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    """OpenAI's error body; ``code`` defaults to :func:`openai_code` of the status. A
    429 or 503 says when to retry (Retry-After)."""
    if status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(
        openai_error(message, kind, param, code or openai_code(status, param)),
        status_code=status,
        headers=headers,
    )


# ---- what the OpenAPI document says of the replies ----------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    # OpenAI's code: context_length_exceeded, model_not_found, invalid_api_key,
    # rate_limit_exceeded, or null.
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body, which every error of the gateway has."""

    error: ErrorDetail


def _error_replies(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented error replies of a route: these statuses, and ``default`` for the
    rest (a 500). Declaring ``default`` also keeps FastAPI from documenting a 422: the
    gateway answers a body that fails validation with 400, as OpenAI does."""
    what = {
        400: "Bad request: the body fails validation or the parameters are refused",
        401: "No credentials, or credentials that are not valid",
        403: "The credentials do not allow this",
        404: "The model is not registered, or has no deployment",
        413: (
            "The body is larger than MAX_BODY_BYTES (32 MiB), or holds more objects, arrays,"
            " keys and decimal numbers than MAX_BODY_STRUCTURE (524,288)"
        ),
        429: "The deployment's queue is full",
        503: "No worker or service can take the request now",
        504: "The request's deadline passed",
    }
    replies: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorBody, "description": what[status]} for status in statuses
    }
    replies["default"] = {"model": ErrorBody, "description": "Any other error"}
    return replies


_GENERATION_REPLIES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with stream: true, server-sent events ending in "
        "data: [DONE]",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **_error_replies(400, 401, 403, 404, 413, 429, 503, 504),
}


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param
        self.code = code or openai_code(status, param)

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError, service: str) -> GatewayError:
        """The HTTP error for a failed call to the iserve ``service`` ("scheduler",
        "deployment", "model"): its status and words, or, where gRPC itself failed (no
        connection, or the call cut off), which service and what happened."""
        status, kind = http_status(exc.code())
        reason = rpc_reason(exc)
        if reason == NotServing.reason:
            # A deployment FAILED or being removed: the server's state, which a client
            # may retry later, not a fault of its request (a 400 said so; a probe).
            status, kind = _STATUS[grpc.StatusCode.UNAVAILABLE]
        param = "model" if reason == "model_not_found" else None
        message = exc.details() or exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE and unreached(message):
            message = f"the iserve {service} service is not reachable: {message}"
        elif exc.code() == grpc.StatusCode.UNAVAILABLE and cut_off_midway(message):
            message = f"the iserve {service} service stopped while it answered: {message}"
        return cls(status, kind, message, param, openai_code(status, param, reason))


# ---- stop strings ---------------------------------------------------------------------
# ---- the backend ----------------------------------------------------------------------
# gRPC metadata: the caller's ``authorization`` entry, or none.
Metadata = tuple[tuple[str, str], ...]

# What cannot be a token (services.auth.tokens.could_be_token) is refused at the gateway:
# passed on, it would fail in the gRPC library (a 500) or on the services' metadata size
# limit (a 429 naming gRPC internals).
log = logging.getLogger("iserve.gateway")

_NOT_A_TOKEN = (
    f"the bearer token is not an iserve token ({MIN_TOKEN_LENGTH}-{MAX_TOKEN_LENGTH} "
    "printable ASCII characters without spaces; `iserve token create` issues them)"
)


# A service that did not answer, as opposed to one that answered no.
_UNANSWERED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass
class Backend:
    """gRPC stubs the gateway calls, and where checkpoints live (for chat templates)."""

    inference: inference_service_pb2_grpc.InferenceServiceStub
    deployments: deployment_service_pb2_grpc.DeploymentServiceStub
    models: model_service_pb2_grpc.ModelServiceStub
    models_root: Path
    rpc_timeout_s: float = 10.0
    # Authentication on: every API request must carry ``Authorization: Bearer <token>``.
    auth: bool = False

    channels: tuple[grpc.aio.Channel, ...] = ()
    # gRPC health on the scheduler's channel (check_token).
    health: health_pb2_grpc.HealthStub | None = None
    # Each model's checkpoint path as last read: a chat is not refused while the model
    # service is unreachable (restarting, say) for a model whose record was read before.
    checkpoint_paths: dict[str, str] = field(default_factory=dict)
    # The 401s given here, before any call (the services log what they refuse).
    refusals: RefusalLog = field(default_factory=lambda: RefusalLog(log))
    # The scheduler's address, dialled again when the instance this gateway's connection
    # reached is draining ("" never), and how long a replaced channel stays open for the
    # streams on it (the scheduler's own drain, and a margin).
    scheduler_address: str = ""
    retire_after_s: float = 60.0
    _redialled_at: float = field(default=-1e9, repr=False)
    _retiring: set = field(default_factory=set, repr=False)

    @classmethod
    def connect(
        cls,
        scheduler: str,
        deploy: str,
        model: str,
        models_root: Path,
        *,
        auth: bool = False,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> Backend:
        """Channels to the three services; call it on the loop that will use them.

        Generations and deployment listings go with the HTTP client's own token (each
        call names it, so the services judge the client, not the gateway); model records,
        read for chat templates, with this process's token (services.transport).
        """
        own = transport.current()
        channels = (
            own.aio_channel(scheduler, token=""),
            own.aio_channel(deploy, token=""),
            own.aio_channel(model),
        )
        return cls(
            inference_service_pb2_grpc.InferenceServiceStub(channels[0]),
            deployment_service_pb2_grpc.DeploymentServiceStub(channels[1]),
            model_service_pb2_grpc.ModelServiceStub(channels[2]),
            models_root,
            auth=auth,
            channels=channels,
            health=health_pb2_grpc.HealthStub(channels[0]),
            scheduler_address=scheduler,
            retire_after_s=drain_timeout_s + 10.0,
        )

    async def redial_scheduler(self) -> bool:
        """A fresh connection to the scheduler when the one this gateway holds reached an
        instance that is draining. A gateway keeps one connection to the scheduler's
        address; behind a Kubernetes Service that is one pod, and during a rollout the
        old pod drains while its successor serves: every new request got the old one's
        503 and /ready failed, for up to the drain timeout. The replaced channel stays
        open ``retire_after_s`` for the streams on it. False (nothing done) without an
        address or within a second of the last redial."""
        now = time.monotonic()
        if not self.scheduler_address or now - self._redialled_at < 1.0:
            return False
        self._redialled_at = now
        old = self.channels[0]
        fresh = transport.current().aio_channel(self.scheduler_address, token="")
        self.inference = inference_service_pb2_grpc.InferenceServiceStub(fresh)
        self.health = health_pb2_grpc.HealthStub(fresh)
        self.channels = (fresh, *self.channels[1:])
        log.info("the scheduler's instance is draining: dialled %s again", self.scheduler_address)

        async def retire() -> None:
            await asyncio.sleep(self.retire_after_s)
            await old.close()

        task = asyncio.ensure_future(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return True

    def caller(self, request: Request) -> Metadata:
        """gRPC metadata carrying the HTTP client's bearer token; 401 when authentication
        is on and it sent none, or something that cannot be a token (before any call)."""
        header = request.headers.get("authorization", "")
        token = bearer(header)
        client = request.client.host if request.client else "unknown"
        if self.auth and len(request.headers.getlist("authorization")) > 1:
            # A proxy in front may act on another of them than the first, which the
            # services would take: two principals, each the caller to one of them.
            said = "more than one Authorization header"
            self.refusals.refused(client, said, request.url.path)
            raise GatewayError(401, "authentication_error", f"{said}: send one")
        if token and not could_be_token(token):
            if self.auth:
                self.refusals.refused(client, "not an iserve token", request.url.path)
                raise GatewayError(401, "authentication_error", _NOT_A_TOKEN)
            # Nothing is checked with authentication off, yet OpenAI's clients must send
            # a key, and those written for vLLM send placeholders ("EMPTY"): sent on as
            # no token, they are served as before instead of refused.
            token = ""
        if not token:
            if self.auth:
                said = (
                    "the Authorization header is not `Bearer <token>`"
                    if header.strip()
                    else "missing `Authorization: Bearer <token>`"
                )
                self.refusals.refused(client, said, request.url.path)
                raise GatewayError(
                    401,
                    "authentication_error",
                    f"{said} (an iserve token; `iserve token create` issues them)",
                )
            return ()
        return (("authorization", f"Bearer {token}"),)

    async def check_token(self, caller: Metadata) -> None:
        """The services' refusal (401) of a token they do not know, or a revoked one, asked
        before the gateway works on a body: only its shape was checked before, so a
        made-up token had 30 MB bodies parsed and validated (seconds of the gateway's
        one event loop each, stalling every other caller: a probe). One call that any
        valid token may make (gRPC health's List) to the scheduler, which every POST
        needs anyway (asked of the deployment service, a completion failed while it
        restarted, where it had served before)."""
        try:
            await self.health.List(
                health_pb2.HealthListRequest(), timeout=self.rpc_timeout_s, metadata=caller
            )
        except grpc.aio.AioRpcError as exc:
            raise GatewayError.from_rpc(exc, "scheduler") from None

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def readiness(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Each service the gateway calls -> its gRPC health status (``SERVING``,
        ``NOT_SERVING`` while it drains, ...) or ``UNREACHABLE``, asked at once."""

        answers = await asyncio.gather(
            *(serving_status(channel, timeout_s) for channel in self.channels)
        )
        if answers[0] == "NOT_SERVING" and await self.redial_scheduler():
            # Draining: another instance may serve at the same address (a rollout).
            answers[0] = await serving_status(self.channels[0], timeout_s)
        return dict(zip(BACKEND_SERVICES, answers, strict=True))

    async def check_deployed_for(self, model_id: str, caller: Metadata) -> None:
        """Returns when the caller may see a deployment of ``model_id``, or authentication
        is off. Otherwise the scheduler's answer for a model without a deployment, whether
        it exists or not: 400 for an id that cannot be a model's, else 404. A token the
        deployment service refuses is its 401 (403 for a role that sees no deployment).

        A deployment in any state will do: the caller may list it anyway, and the
        scheduler answers for one not READY (503 while it starts, which a 404 here would
        turn into "give up"). One ListDeployments with the caller's token, uncached, so a
        revoked token is refused as soon as the services refuse it."""
        if not self.auth:
            return  # every caller may use everything: the model record says what is missing
        try:
            reply = await self.deployments.ListDeployments(
                deploy_pb.ListDeploymentsRequest(model_id=model_id),
                timeout=self.rpc_timeout_s,
                metadata=caller,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                # Not the internal method the role may not call (a chat's 403 named
                # ListDeployments; a tester): what the caller asked.
                raise GatewayError(
                    *http_status(exc.code()),
                    f"this token may not generate: chat completions are for {_LISTERS} tokens",
                ) from None
            raise GatewayError.from_rpc(exc, "deployment") from None
        if reply.deployments or await self._model_of_deployment(model_id, caller):
            return
        raise GatewayError(404, "not_found_error", no_deployment(model_id), "model")

    async def _model_of_deployment(self, name: str, caller: Metadata) -> str | None:
        """The model of deployment ``name`` given as ``model`` (which then names that
        deployment alone, as the scheduler routes it), when the caller may see it; else
        None (no such deployment, one hidden from the caller, or no answer)."""
        try:
            reply = await self.deployments.GetDeployment(
                deploy_pb.GetDeploymentRequest(deployment_id=name),
                timeout=self.rpc_timeout_s,
                metadata=caller,
            )
        except grpc.aio.AioRpcError:
            return None
        return reply.deployment.model_id

    async def chat_template(self, model_id: str, caller: Metadata) -> tuple[str, dict[str, str]]:
        """The chat template of ``model_id``'s checkpoint and its special tokens.

        The model record is read with the gateway's own token, so only once the caller
        has shown it may use the model (:meth:`check_deployed_for`): else any token, even
        one the services refuse, would learn which models exist and which have a
        template, and make the gateway read their checkpoints."""
        await self.check_deployed_for(model_id, caller)
        try:
            reply = await self.models.GetModel(
                model_pb.GetModelRequest(model_id=model_id), timeout=self.rpc_timeout_s
            )
            path = self.checkpoint_paths[model_id] = reply.model.checkpoint_path
        except grpc.aio.AioRpcError as exc:
            # Read fresh each time (a model registered again may have moved), but the
            # path read last will do while the model service does not answer.
            path = self.checkpoint_paths.get(model_id)
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                # A deployment's id: its model's template.
                model = await self._model_of_deployment(model_id, caller)
                if model and model != model_id:
                    return await self.chat_template(model, caller)
                if model is None and looks_like_deployment_id(model_id):
                    # A removed deployment's id, as likely as an unregistered model's.
                    raise GatewayError(
                        404, "not_found_error", no_deployment(model_id), "model"
                    ) from None
            if path is None or exc.code() not in _UNANSWERED:
                raise GatewayError.from_rpc(exc, "model") from None
        try:
            return read_template(self.models_root / path, self.models_root)
        except UnreadableChatTemplate as exc:
            # The model's files (changed since registration, which refuses them): the
            # operator's to hear of, not the client's request to blame with a 400.
            log.error("model %r: %s", model_id, exc)
            raise GatewayError(500, "internal_error", f"model {model_id!r}: {exc}") from None
        except NoChatTemplate as exc:
            raise GatewayError(400, "invalid_request_error", f"model {model_id!r}: {exc}") from None


@dataclass
class _Generation:
    """One request's Generate call, opened and its first reply read (so that errors
    before any token become HTTP errors, not a broken stream)."""

    call: Any
    first: inference_pb.GenerateResponse | None


def _draining(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the scheduler refused a call because it is draining."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and refused_as_draining(
        exc.details() or "", "scheduler"
    )


async def _open(
    backend: Backend,
    request: inference_pb.GenerateRequest,
    metadata: tuple = (),
    *,
    again: bool = True,
) -> _Generation:
    stub = backend.inference
    call = stub.Generate(request, metadata=metadata)
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as exc:
        call.cancel()
        # Refused by a draining instance before any token: once more over a fresh
        # connection (another call may have made it already), which may reach another.
        if (
            again
            and _draining(exc)
            and (backend.inference is not stub or await backend.redial_scheduler())
        ):
            return await _open(backend, request, metadata, again=False)
        raise GatewayError.from_rpc(exc, "scheduler") from None
    except asyncio.CancelledError:  # the client went away while the request waited
        call.cancel()
        raise
    return _Generation(call, None if first is grpc.aio.EOF else first)


async def _open_all(
    backend: Backend, requests: list[inference_pb.GenerateRequest], metadata: tuple = ()
) -> list[_Generation]:
    """Every request's generation, opened together (one per prompt of a completions
    request); when one is refused, the others are cancelled and its error is raised,
    its ``prompt_index`` set to which prompt's it was."""

    async def opened(index: int, request: inference_pb.GenerateRequest) -> _Generation:
        try:
            return await _open(backend, request, metadata)
        except GatewayError as exc:
            exc.prompt_index = index
            raise

    tasks = [asyncio.ensure_future(opened(i, r)) for i, r in enumerate(requests)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(tasks)
        for task in tasks:  # opened before the refusal: close its call
            if not task.cancelled() and task.exception() is None:
                task.result().call.cancel()
        raise


# nginx's status for a request whose client closed the connection first (never sent).
CLIENT_CLOSED_REQUEST = 499
# Every response's request id, as OpenAI's API names it.
REQUEST_ID_HEADER = "x-request-id"


async def _client_gone(http: Request) -> None:
    """Returns once the client has disconnected. The body has been read by then, so the
    next message the server has for this request is ``http.disconnect``."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_gone(http: Request, work):
    """``work``'s result, or None when the client disconnects first: ``work`` is then
    cancelled, and with it its Generate call (the scheduler drops the request from its
    queue, or the worker stops generating). sse-starlette watches a streamed reply once
    it has started; this covers the wait before the first token and a whole non-streamed
    reply."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(http))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _replies(gen: _Generation) -> AsyncIterator[inference_pb.GenerateResponse]:
    try:
        if gen.first is not None:
            yield gen.first
        while True:
            reply = await gen.call.read()
            if reply is grpc.aio.EOF:
                return
            yield reply
    finally:
        gen.call.cancel()  # a no-op once finished; cancels the worker's generation if not


def served_model_id(model: str) -> str:
    """``model`` when it can name an iserve model. A name that cannot (a hub name such as
    ``meta-llama/Llama-3.1-8B``, capitals) is a model this server does not have: the 404
    OpenAI gives a model it does not serve, not a 400, so that a client's fallback on an
    unknown model works; the message says what the ids here look like."""
    try:
        check_model_id(model)
    except InvalidArgument as exc:
        raise GatewayError(
            404, "not_found_error", f"model {shown(model)} does not exist here ({exc})", "model"
        ) from None
    return model


def _generate_request(
    body: GenerationBody, prompt: str | list[int], max_tokens: int | None
) -> inference_pb.GenerateRequest:
    """The GenerateRequest of a body, its prompt text or token ids."""
    sampling = common.SamplingParams(
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        stop_token_ids=body.stop_token_ids or [],
        # The worker ends the generation at them (services.stop_strings): a finished
        # generation, not a call the gateway cancels.
        stop=body.stop_strings(),
        ignore_eos=body.ignore_eos,
    )
    # Only the likeliest token: greedy, as the message's top_p 0 reads as unset. Asked of
    # the float32 the message holds: a top_p below 7e-46 is 0 there (it sampled from the
    # whole vocabulary).
    if body.top_p is not None and sampling.top_p == 0:
        sampling.temperature, sampling.top_p = 0.0, 1.0
    if body.seed is not None:
        sampling.seed = body.seed % 2**64  # an int64's two's complement
    return inference_pb.GenerateRequest(
        model_id=body.model,
        **({"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}),
        max_tokens=max_tokens or 0,
        sampling=sampling,
        priority=body.priority,
        deadline_ms=body.deadline_ms,
    )


def _not_unicode(text: str) -> str:
    surrogate = next((c for c in text if "\ud800" <= c <= "\udfff"), text[:1])
    escaped = surrogate.encode("unicode_escape").decode("ascii")
    return f"text that is not valid Unicode: {escaped} (a lone surrogate)"


# The names a body's location can hold (with list indices); pydantic also puts the
# member of a union it tried there ("logprobs.bool", "stop.list[str]"), which is no
# field a client sent.
_BODY_FIELDS = frozenset(
    name
    for model in (ChatBody, CompletionBody, ChatMessage, StreamOptions)
    for name in model.model_fields
)


def _where(error: dict[str, Any]) -> str:
    """The field path of ``error`` as the client wrote it: ``messages.0.content``."""
    return ".".join(str(p) for p in error.get("loc", ()) if isinstance(p, int) or p in _BODY_FIELDS)


def _located(errors: list[dict[str, Any]]) -> str:
    """``field.path: reason`` for each field, a union's refusals of one value joined by
    "or"; an error of the whole body says what a body must be."""
    reasons: dict[str, list[str]] = {}
    for error in errors:
        where = _where(error)
        if not where:
            if error.get("type") == "missing":
                return "the body is empty: send a JSON object (content-type: application/json)"
            return "the body must be a JSON object (content-type: application/json)"
        reason = _reason(error)
        if reason not in reasons.setdefault(where, []):
            reasons[where].append(reason)
    return "; ".join(f"{where}: {' or '.join(said)}" for where, said in reasons.items())


def _reason(error: dict[str, Any]) -> str:
    """A validation error's message; pydantic's own, but for text that is not Unicode, and
    without the "Value error, " pydantic puts before a validator's own message."""
    if error.get("type") == "string_unicode" and isinstance(error.get("input"), str):
        return _not_unicode(error["input"])
    return str(error.get("msg")).removeprefix("Value error, ")


# ---- the body size limit -----------------------------------------------------------
# No prompt a model can take comes near this (a million-token context is a few MiB of
# text, ~6x that JSON-escaped); without a bound, a body of gigabytes would be read and
# parsed into memory before any check.
MAX_BODY_BYTES = 32 * 2**20
_TOO_LARGE = f"the body is larger than {MAX_BODY_BYTES} bytes"
# What a body may hold outside its strings of what costs JSON parsing most: objects,
# arrays, keys and decimal numbers. Parsing runs on the event loop and holds every other
# request meanwhile: 32 MiB of those took 1-2.3 s (2.4 million keys, 10 million empty
# arrays, 8 million decimals; a tester's 4 such bodies held a short completion 21 s),
# where 32 MiB of text takes 0.02 s and of integers 0.4-0.8 s. No request comes near
# the bound: MAX_MESSAGES messages and parts and twice MAX_TEMPLATE_VALUES template
# values (in messages and in chat_template_kwargs), a decimal counted twice, hold at most
# about 330,000 of them.
MAX_BODY_STRUCTURE = 2**19
_TOO_STRUCTURED = (
    f"the body holds more than {MAX_BODY_STRUCTURE} JSON objects, arrays, keys and decimal"
    " numbers (outside its strings): no request needs that many, and each costs the"
    " gateway parsing time that every other request waits for"
)
# Bytes json_structure looks at between its checks against the bound.
_STRUCTURE_SLICE = 2**20


def json_structure(body: bytes, bound: int = MAX_BODY_STRUCTURE) -> int:
    """How many objects, arrays, keys and decimal numbers ``body`` holds outside its
    strings, counted by their marks (opening brackets, colons, a decimal point or
    exponent after a digit) in linear time before it is parsed, and up to the first
    count past ``bound``. Where the marks, strings included, are within ``bound``, their
    count, which is never less (text and token ids stop there: ~0.05 s for 32 MiB); else
    the marks outside strings, a MiB at a time by numpy's array operations (not a step
    per string, which took 1.5 s for 6 million short strings), until they pass it
    (0.1-0.2 s for 32 MiB)."""
    count = sum(body.count(mark) for mark in (b"{", b"[", b":", b".", b"e", b"E"))
    if count <= bound:
        return count
    # Escaped backslashes first, so that the quote after one ends its string; then no
    # quote is left inside a string, and a byte is in one after an odd count of quotes.
    bare = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    count = 0
    inside = False  # whether the slice starts inside a string
    previous = b" "  # the byte before the slice
    for start in range(0, len(bare), _STRUCTURE_SLICE):
        chunk = bare[start : start + _STRUCTURE_SLICE]
        quotes = chunk.count(b'"')
        if inside and not quotes:  # all of it in one string (a long prompt's middle)
            previous = chunk[-1:]
            continue
        window = np.frombuffer(previous + chunk, np.uint8)
        piece, before = window[1:], window[:-1]
        opens = (piece == ord("{")) | (piece == ord("[")) | (piece == ord(":"))
        decimal = (piece == ord(".")) | (piece == ord("e")) | (piece == ord("E"))
        marks = opens | (decimal & (before >= ord("0")) & (before <= ord("9")))
        if quotes:
            parity = np.bitwise_xor.accumulate((piece == ord('"')).view(np.uint8))
            marks &= parity == int(inside)  # outside: as many quotes as at the start, mod 2
        count += int(np.count_nonzero(marks))
        inside ^= quotes % 2 == 1
        previous = chunk[-1:]
        if count > bound:
            break
    return count


class HeadAsGet:
    """ASGI middleware serving HEAD as GET: HTTP servers take HEAD wherever they take GET
    (RFC 9110, 9.3.2), and FastAPI's routes take only the methods they name (HEAD
    /v1/models was a 405). The app sees a GET; uvicorn, whose own scope still says HEAD,
    sends its status and headers and leaves out the body. On a path without GET it is a
    405 naming the methods the path takes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware refusing a body above ``MAX_BODY_BYTES`` with 413: at once by its
    Content-Length, else once the chunks read pass it; and one whose JSON structure passes
    ``MAX_BODY_STRUCTURE`` with 413 once it is read whole, before it is parsed (the
    endpoint never runs)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            too_large = error_response(413, "invalid_request_error", _TOO_LARGE)
            return await too_large(scope, receive, send)
        received = 0
        chunks: list[bytes] = []

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            # Starlette's HTTPException passes FastAPI's body reading and reaches the
            # app's handler, which answers in OpenAI's error body.
            if received > MAX_BODY_BYTES:
                raise StarletteHTTPException(413, _TOO_LARGE)
            if not message.get("more_body", False):
                body = b"".join(chunks)
                chunks.clear()
                if json_structure(body) > MAX_BODY_STRUCTURE:
                    raise StarletteHTTPException(413, _TOO_STRUCTURED)
            return message

        return await self.app(scope, limited, send)


# ---- the app --------------------------------------------------------------------------
# What a 404 for an unknown path lists.
_OPENAI_ENDPOINTS = (
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
)
# The /metrics endpoint label of a request no route takes.
UNMATCHED = "unmatched"


def _caller(http: Request) -> Metadata:
    """The caller's token as gRPC metadata (``Backend.caller``), as a dependency: FastAPI
    solves it before it validates the body, so a request without a token gets its 401
    before any work on its body (a 32 MiB body of small items is a second of it), and
    first, as OpenAI answers."""
    return http.app.state.backend.caller(http)


Caller = Annotated[Metadata, Depends(_caller)]


class TokenFirst(APIRoute):
    """A route whose request, with authentication on, has its token checked by the
    services before its body is read (FastAPI reads and parses a body before it solves
    any dependency, the Caller one included)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            backend = getattr(request.app.state, "backend", None)
            if backend is not None and backend.auth and request.method == "POST":
                await backend.check_token(backend.caller(request))
            return await handler(request)

        return checked


def create_app(
    connect: Callable[[], Backend],
    cors_origins: tuple[str, ...] = (),
    stream_grace_s: float = 0.0,
    tls: TlsFiles | None = None,
) -> FastAPI:
    """The app; ``connect`` builds the backend on the server's own event loop (gRPC aio
    channels belong to the loop they were made on). Pages from ``cors_origins`` (``*``:
    any) may call it from a browser (Starlette's CORSMiddleware answers the preflight;
    the token goes in the Authorization header, so no cookies are allowed). A stream in
    flight when the server is told to stop runs on for up to ``stream_grace_s`` seconds
    (sse-starlette's shutdown grace period; 0 cuts it at once, without its [DONE]).
    ``tls``: the gateway's TLS settings, whose certificate's expiry /metrics shows."""
    backend: Backend | None = None
    renders = RenderPool()  # chat templates run beside the event loop, bounded

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        nonlocal backend
        backend = connect()
        _app.state.backend = backend  # for the Caller dependency
        try:
            yield
        finally:
            renders.close()
            await backend.close()

    app = FastAPI(
        title="iserve OpenAI-compatible gateway",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        # No 307 from "/v1/completions/" to the path without the slash: it answered before
        # the token was checked (a tester), with an absolute http:// URL that a TLS
        # proxy in front would not serve. A 404 names the path without it instead.
        redirect_slashes=False,
    )
    app.router.route_class = TokenFirst
    app.add_middleware(BodyLimit)
    app.add_middleware(HeadAsGet)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            # Any header a client sends (the OpenAI SDKs add x-stainless-*): the origins
            # are the allow-list, and no credentials (cookies) are allowed.
            allow_headers=["*"],
            expose_headers=[REQUEST_ID_HEADER],  # a browser's script may read it
            max_age=600,
        )
    registry = new_registry()
    certificate_expiry(registry, tls)
    requests = Counter(
        "iserve_gateway_requests",
        "HTTP requests by endpoint and status",
        ["endpoint", "status"],
        registry=registry,
    )
    streams = Counter(
        "iserve_gateway_streams",
        "Streamed replies by endpoint and how they ended: completed (every generation "
        "ended; its [DONE] sent, or on its way as the client left), failed (an error "
        "event: the HTTP status was 200 already) or cancelled (the client left first); a "
        "client that left before the stream's first byte is a 499 of "
        "iserve_gateway_requests_total only",
        ["endpoint", "outcome"],
        registry=registry,
    )
    latency = Histogram(
        "iserve_gateway_request_seconds",
        "Time from request to the reply's last byte (a stream's end), or to the client leaving",
        ["endpoint"],
        registry=registry,
    )

    def endpoint_of(scope: dict[str, Any]) -> str:
        """The path template of the route that takes the request (the router's choice:
        the first full match, else the first that takes the path but not the method), or
        UNMATCHED. Matched here rather than read from the scope, because a request the
        body limit answers never reaches the router."""
        partial = None
        for route in app.router.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route.path_format
            if match is Match.PARTIAL and partial is None:
                partial = route.path_format
        return partial or UNMATCHED

    @app.middleware("http")
    async def count(request: Request, call_next):
        started = time.perf_counter()
        # OpenAI's x-request-id (its SDKs keep it as the response's _request_id): the id
        # of the request the scheduler logs and the completion's id carries, so a
        # client's report finds the services' log lines.
        request.state.request_id = uuid.uuid4().hex
        response = await call_next(request)
        response.headers[REQUEST_ID_HEADER] = request.state.request_id
        # Labelled by route, never by the path sent: /metrics is open, and a series per
        # path would name the model ids asked for and grow with every path anyone sends.
        endpoint = endpoint_of(request.scope)
        requests.labels(endpoint, str(response.status_code)).inc()
        # Timed to the last byte sent: the body goes out after this returns (all of a
        # stream's tokens), and a stream was timed to its first (a tester).
        body = response.body_iterator

        async def timed_body():
            try:
                async for chunk in body:
                    yield chunk
            finally:
                latency.labels(endpoint).observe(time.perf_counter() - started)

        response.body_iterator = timed_body()
        return response

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError):
        if exc.status >= 500:
            # The server's side failed (a service unreachable, an internal error): the
            # operator's to know, and the log said nothing of it (a probe). A client's
            # own 4xx are its to read, not logged. A 504 is a deadline's: EDF's
            # admission control refusing a first token it predicts late, which under
            # overload is hundreds a minute of the service working as meant (a tester).
            (log.info if exc.status == 504 else log.warning)(
                "%s %s -> %d %s: %s",
                request.method,
                request.url.path,
                exc.status,
                exc.kind,
                exc.message,
            )
        # A 401 names the scheme it wants (RFC 6750), as clients that retry with a token
        # expect.
        challenge = {"WWW-Authenticate": 'Bearer realm="iserve"'} if exc.status == 401 else None
        return error_response(
            exc.status, exc.kind, exc.message, exc.param, headers=challenge, code=exc.code
        )

    async def unauthenticated(request: Request) -> JSONResponse | None:
        """With authentication on, a request to an OpenAI path without a token is a 401
        before anything else, as OpenAI answers: on a path this server has or not, and
        with a body FastAPI could not parse (it parses before it solves the Caller
        dependency)."""
        backend = getattr(request.app.state, "backend", None)
        if not (request.url.path.startswith("/v1/") and backend):
            return None
        try:
            backend.caller(request)
        except GatewayError as refused:
            return await gateway_error(request, refused)
        return None

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        if refused := await unauthenticated(request):
            return refused
        errors = exc.errors()
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        parsed = media.startswith("application/") and media.endswith(("/json", "+json"))
        if errors and not _where(errors[0]) and not parsed:
            # A JSON object sent as a form (curl -d's default) or as text (text/json too:
            # FastAPI reads application/json and application/*+json only) is not read as
            # JSON: say so, not that the body is no object.
            said = f"content-type {media!r}" if media else "no content-type"
            message = f"the body was sent with {said}: send it as application/json"
            return error_response(415, "invalid_request_error", message)
        if errors and errors[0].get("type") == "json_invalid":
            # Its loc is the character offset, not a field.
            at = errors[0].get("loc", ("body", "?"))[-1]
            error = (errors[0].get("ctx") or {}).get("error", "")
            message = (
                f"the body is not valid JSON (at character {at}{': ' if error else ''}{error})"
            )
            return error_response(400, "invalid_request_error", message)
        where = _where(errors[0]) if errors else None
        message = _located(errors)
        return error_response(
            400, "invalid_request_error", message or "invalid body", where or None
        )

    @app.exception_handler(UnicodeEncodeError)
    async def not_unicode(_request: Request, exc: UnicodeEncodeError):
        # JSON may escape a lone surrogate ("\ud800"); no UTF-8 text holds one, so the
        # request cannot be passed on (a 500 before).
        message = f"the request holds {_not_unicode(exc.object[exc.start : exc.end])}"
        return error_response(400, "invalid_request_error", message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # Unknown paths and methods answer in OpenAI's error body too.
        # A 405 keeps Starlette's Allow header (RFC 9110 requires it).
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code in (400, 404, 405) and (refused := await unauthenticated(request)):
            return refused
        if exc.status_code == 404 and message == "Not Found":
            # A client pointed at an endpoint OpenAI has and this server does not
            # (/v1/embeddings, /v1/responses): say which it has.
            path = request.url.path
            message = (
                f"Not Found: {path[:200]!r} is not served here; the OpenAI "
                f"endpoints served are {', '.join(_OPENAI_ENDPOINTS)}"
            )
            if path.endswith("/") and any(
                route.path == path.rstrip("/") for route in request.app.routes
            ):
                message = f"Not Found: {path[:200]!r}: send it without the trailing slash"
        if exc.status_code == 400 and exc.__cause__ is not None:
            # FastAPI's "There was an error parsing the body": say what the parser met (a
            # nesting too deep, an integer of thousands of digits, bytes not UTF-8).
            cause = exc.__cause__
            message = f"the body is not valid JSON ({type(cause).__name__}: {cause})"[:300]
        headers = exc.headers
        if exc.status_code == 405 and headers and "GET" in headers.get("Allow", "").split(", "):
            headers = {**headers, "Allow": f"{headers['Allow']}, HEAD"}  # HeadAsGet's
        return error_response(exc.status_code, kind, message, headers=headers)

    @app.get("/health")
    async def health():
        """Liveness: the process answers (a restart would not help a service behind it)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        """Readiness: 200 while the scheduler, which every generation goes through, is
        SERVING; 503 (with Retry-After) while it is unreachable or draining. The body gives
        each service's status; the deployment and model services being down leaves
        generations working (the listing and new chat templates wait for them)."""
        services = await backend.readiness()
        if services["scheduler"] != "SERVING":
            return JSONResponse(
                {"status": "unavailable", "services": services},
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        degraded = any(status != "SERVING" for status in services.values())
        return {"status": "degraded" if degraded else "ready", "services": services}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def ready_deployments(http: Request) -> list[deploy_pb.Deployment]:
        """The READY deployments the caller may generate on."""
        usable = await usable_deployments(http)
        return [d for d in usable if d.state == deploy_pb.DEPLOYMENT_STATE_READY]

    async def usable_deployments(http: Request) -> list[deploy_pb.Deployment]:
        """The deployments the caller may generate on, in any state."""
        try:
            reply = await backend.deployments.ListDeployments(
                deploy_pb.ListDeploymentsRequest(usable_only=True),
                timeout=backend.rpc_timeout_s,
                metadata=backend.caller(http),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                # Not the internal method the role may not call: what the caller asked.
                raise GatewayError(
                    *http_status(exc.code()),
                    f"this token may not list models: GET /v1/models is for {_LISTERS} tokens",
                ) from None
            raise GatewayError.from_rpc(exc, "deployment") from None
        return list(reply.deployments)

    def served_models(ready: list[deploy_pb.Deployment]) -> dict[str, int]:
        """Model id -> creation time (s) of its earliest ready deployment (as OpenAI lists
        the models a key may use)."""
        served: dict[str, int] = {}
        for d in ready:
            created = d.created_at_unix_ms // 1000
            served[d.model_id] = min(served.get(d.model_id, created), created)
        return served

    def model_object(model_id: str, created: int) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "iserve"}

    @app.get("/v1/models", responses=_error_replies(401, 403, 503))
    async def list_models(http: Request):
        served = served_models(await ready_deployments(http))
        return {"object": "list", "data": [model_object(m, served[m]) for m in sorted(served)]}

    @app.get("/v1/models/{model_id:path}", responses=_error_replies(401, 403, 404, 503))
    async def retrieve_model(model_id: str, http: Request):
        # OpenAI's retrieve. iserve's ids hold no '/', but a hub-style name asked for
        # (meta-llama/Llama-3.1-8B) gets this 404 naming it, not an unknown path's.
        usable = await usable_deployments(http)
        ready = [d for d in usable if d.state == deploy_pb.DEPLOYMENT_STATE_READY]
        served = served_models(ready)
        if model_id in served:
            return model_object(model_id, served[model_id])
        # A deployment's id, which `model` may name to pin a request to it (not listed:
        # the list names each model once): its model is the parent, as vLLM lists an
        # adapter's base model.
        for d in ready:
            if d.deployment_id == model_id:
                return {
                    **model_object(model_id, d.created_at_unix_ms // 1000),
                    "parent": d.model_id,
                }
        starting = [
            d
            for d in usable
            if model_id in (d.model_id, d.deployment_id)
            and d.state == deploy_pb.DEPLOYMENT_STATE_STARTING
        ]
        if starting:
            # As a generation for it is answered (a 503 the SDKs retry), not a 404 that
            # says it does not exist (a tester).
            raise GatewayError(
                503,
                "service_unavailable_error",
                f"model {shown(model_id)} has no ready deployment yet: deployment "
                f"{starting[0].deployment_id} is STARTING"
                + (f" ({starting[0].state_reason})" if starting[0].state_reason else ""),
                "model",
            )
        raise GatewayError(
            404, "not_found_error", f"model {shown(model_id)} has no ready deployment", "model"
        )

    @app.post("/v1/completions", responses=_GENERATION_REPLIES)
    async def completions(body: CompletionBody, http: Request, caller: Caller):
        served_model_id(body.model)
        requests = []
        for prompt in body.prompt:  # a generation, and a choice, per prompt
            if body.max_tokens_given:
                request = _generate_request(body, prompt, body.max_tokens)
            else:  # OpenAI's 16, as far as the deployment allows
                request = _generate_request(body, prompt, None)
                request.max_tokens_default = COMPLETION_MAX_TOKENS
            request.prompt_has_special_tokens = not body.add_special_tokens
            requests.append(request)
        return await _respond(body, requests, caller, http, chat=False)

    @app.post("/v1/chat/completions", responses=_GENERATION_REPLIES)
    async def chat_completions(body: ChatBody, http: Request, caller: Caller):
        served_model_id(body.model)
        template, tokens = await backend.chat_template(body.model, caller)
        try:
            prompt = await renders.render(
                template,
                [m.as_template_input() for m in body.messages],
                tokens,
                body.add_generation_prompt,
                body.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise GatewayError(400, "invalid_request_error", str(exc), "messages") from None
        except BrokenChatTemplate as exc:
            # The model's fault, not the client's: the operator has to hear of it.
            log.error("model %r: %s", body.model, exc)
            raise GatewayError(500, "internal_error", f"model {body.model!r}: {exc}") from None
        request = _generate_request(body, prompt, body.max_tokens)
        # The template wrote the special tokens (BOS) it wants; the tokenizer adds none
        # unless asked to (add_special_tokens, vLLM's).
        request.prompt_has_special_tokens = not body.add_special_tokens
        return await _respond(body, [request], caller, http, chat=True)

    async def _respond(
        body: GenerationBody,
        requests: list[inference_pb.GenerateRequest],
        caller: tuple,
        http: Request,
        chat: bool,
    ):
        for index, request in enumerate(requests):  # each prompt's: the first's, then -1, -2…
            request.request_id = http.state.request_id + (f"-{index}" if index else "")

        async def reply():
            try:
                gens = await _open_all(backend, requests, caller)
            except GatewayError as exc:
                if exc.status == 400 and exc.param is None:
                    exc.param = refused_param(exc.message, body, chat, exc.code)
                    if exc.param == "max_completion_tokens":
                        # The scheduler's message names its own field.
                        exc.message = exc.message.replace("max_tokens", exc.param, 1)
                    index = getattr(exc, "prompt_index", None)
                    if exc.param == "prompt" and len(requests) > 1 and index is not None:
                        # Which of the list's prompts (a tester could not tell).
                        exc.message = f"prompt {index} (of {len(requests)}, from 0): {exc.message}"
                raise
            ident = ("chatcmpl-" if chat else "cmpl-") + requests[0].request_id
            created = int(time.time())
            if body.stream:
                usage_too = bool(body.stream_options and body.stream_options.include_usage)
                endpoint = endpoint_of(http.scope)
                events = _stream(
                    gens,
                    body,
                    ident,
                    created,
                    chat,
                    usage_too,
                    ended=lambda outcome: streams.labels(endpoint, outcome).inc(),
                )
                return EventSourceResponse(
                    events, ping=15, sep="\n", shutdown_grace_period=stream_grace_s
                )
            return await _complete(gens, body, ident, created, chat)

        answer = await _unless_client_gone(http, reply())
        return Response(status_code=CLIENT_CLOSED_REQUEST) if answer is None else answer

    return app


# A service's refusal of a generation begins with the request field it is about:
# "max_tokens 600 exceeds ...", "prompt has 9000 tokens; ...", "sampling.top_p must ...",
# "sampling: temperature must ...".
_SAMPLING_FIELD = re.compile(r"sampling[.:]\s*(temperature|top_p|top_k|seed|stop)\b")


def refused_param(
    message: str, body: GenerationBody, chat: bool, code: str | None = None
) -> str | None:
    """OpenAI's ``param`` for a 400 a service gave a generation: the body field its
    message names first, None when it names none. A deadline no queue could meet is the
    request's ``deadline_ms`` when it set one, else its token limit (what it can lower:
    the deployment's objective set the deadline)."""
    given = getattr(body, "max_completion_tokens", None)
    limit = "max_completion_tokens" if given else "max_tokens"
    if code == DeadlineUnreachable.reason:
        return "deadline_ms" if body.deadline_ms else limit
    if message.startswith("max_tokens"):
        return limit
    if message.startswith("prompt"):
        return "messages" if chat else "prompt"
    sampling = _SAMPLING_FIELD.match(message)
    return sampling.group(1) if sampling else None


def _finish_reason(final: inference_pb.GenerateFinal | None) -> str:
    """OpenAI's finish_reason: the generation's own ("stop" for a stop string too)."""
    if final is None:
        return "stop"
    return _FINISH.get(final.finish_reason, "stop")


class _Count:
    """Tokens seen in the deltas, for the usage of a generation that sent no final
    message."""

    def __init__(self) -> None:
        self.prompt = self.completion = 0

    def add(self, delta: inference_pb.TokenDelta) -> None:
        self.prompt = self.prompt or delta.prompt_tokens
        self.completion += len(delta.token_ids)


def _usage(final: inference_pb.GenerateFinal | None, seen: _Count) -> dict[str, int]:
    prompt = final.usage.prompt_tokens if final else seen.prompt
    completion = final.usage.completion_tokens if final else seen.completion
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _usage_of(ends: list[tuple[inference_pb.GenerateFinal | None, _Count]]) -> dict[str, int]:
    """The usage of every generation of a request together."""
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for final, seen in ends:
        for key, value in _usage(final, seen).items():
            total[key] += value
    return total


async def _collect(gen: _Generation) -> tuple[str, inference_pb.GenerateFinal | None, _Count]:
    """A generation's whole text, final message and token counts."""
    text, final, seen = [], None, _Count()
    try:
        async for reply in _replies(gen):
            if reply.HasField("delta"):
                seen.add(reply.delta)
                text.append(reply.delta.text)
            elif reply.HasField("final"):
                final = reply.final
    except grpc.aio.AioRpcError as exc:
        raise GatewayError.from_rpc(exc, "scheduler") from None
    return "".join(text), final, seen


async def _complete(
    gens: list[_Generation], body: GenerationBody, ident: str, created: int, chat: bool
):
    tasks = [asyncio.ensure_future(_collect(gen)) for gen in gens]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:  # a failed generation fails the request: stop the others
        await cancel_and_wait(tasks)
        raise
    choices = []
    for index, (content, final, _seen) in enumerate(results):
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": None,
            "finish_reason": _finish_reason(final),
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        choices.append(choice)
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": _usage_of([(final, seen) for _, final, seen in results]),
    }


async def _stream(
    gens: list[_Generation],
    body: GenerationBody,
    ident: str,
    created: int,
    chat: bool,
    usage_too: bool,
    ended: Callable[[str], None] = lambda _outcome: None,
) -> AsyncIterator[str]:
    """The SSE events of a request's streamed generations (sse-starlette adds
    ``data: ``): each generation's chunks carry its ``index``, in the order they come.
    ``ended`` is told how the stream ended: "completed", "failed" (an error event) or
    "cancelled" (closed before either: the client left)."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, text: str | None, reason: str | None, role: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": None,
                "finish_reason": reason,
            }
        event = {
            "id": ident,
            "object": kind,
            "created": created,
            "model": body.model,
            "choices": [choice],
        }
        if usage_too:
            # OpenAI's form: with include_usage every chunk has "usage", null until the
            # last one (a client may read chunk["usage"] on each).
            event["usage"] = None
        return json.dumps(event)

    events: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: _Generation) -> None:
        final, seen = None, _Count()
        try:
            async for reply in _replies(gen):
                if reply.HasField("delta"):
                    seen.add(reply.delta)
                    if reply.delta.text:
                        await events.put(("text", index, reply.delta.text))
                elif reply.HasField("final"):
                    final = reply.final
        except grpc.aio.AioRpcError as exc:
            await events.put(("error", index, exc))
            return
        await events.put(("end", index, (final, seen)))

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
    outcome = "cancelled"  # unless it gets to its end
    try:
        if chat:
            yield chunk(0, "", None, role=True)
        ends: dict[int, tuple] = {}
        while len(ends) < len(gens):
            what, index, value = await events.get()
            if what == "text":
                yield chunk(index, value, None)
            elif what == "end":
                ends[index] = value
                yield chunk(index, None if chat else "", _finish_reason(value[0]))
            else:
                error = GatewayError.from_rpc(value, "scheduler")
                if error.status >= 500:
                    log.warning(
                        "stream %s ended with %d %s: %s",
                        ident,
                        error.status,
                        error.kind,
                        value.details(),
                    )
                outcome = "failed"
                yield json.dumps(openai_error(value.details(), error.kind, error.param, error.code))
                yield "[DONE]"
                return
        if usage_too:
            yield json.dumps(
                {
                    "id": ident,
                    "object": kind,
                    "created": created,
                    "model": body.model,
                    "choices": [],
                    "usage": _usage_of([ends[i] for i in range(len(gens))]),
                }
            )
        outcome = "completed"
        yield "[DONE]"
    finally:
        ended(outcome)
        for task in tasks:  # the client went away, or one generation failed
            task.cancel()
