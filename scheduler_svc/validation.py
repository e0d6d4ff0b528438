"""Checks of a GenerateRequest; each failure is an InvalidArgument saying what to fix."""

from __future__ import annotations

import math
from collections.abc import Callable

from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as inference_pb
from services.errors import ContextLengthExceeded, InvalidArgument
from services.stop_strings import check_stop_strings, check_stop_token_ids
from services.token_limits import DEFAULT_MAX_OUTPUT_TOKENS, sequence_length


def check_request(request: inference_pb.GenerateRequest) -> None:
    """Checks that need no deployment: target, prompt, sampling. (The request id is
    checked with every RPC's, by the server (``services.grpc_server``); the target's id
    where it is looked up, by the router; max_tokens, once :func:`resolve_max_tokens`
    has filled it in, against the deployment.)"""
    target = request.WhichOneof("target")
    if target is None or not getattr(request, target):
        raise InvalidArgument("set model_id or deployment_id")
    if not request.prompt and not request.prompt_token_ids:
        raise InvalidArgument("prompt is empty")
    if request.HasField("sampling"):
        sampling = request.sampling
        if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
            raise InvalidArgument(
                f"sampling.temperature must be a finite number ≥ 0, got {sampling.temperature}"
            )
        if not 0 <= sampling.top_p <= 1:
            raise InvalidArgument(f"sampling.top_p must be within [0, 1], got {sampling.top_p}")
        try:
            check_stop_strings(tuple(sampling.stop))
        except ValueError as exc:
            raise InvalidArgument(f"sampling.stop: {exc}") from None
        try:
            check_stop_token_ids(sampling.stop_token_ids)
        except ValueError as exc:
            raise InvalidArgument(f"sampling.stop_token_ids: {exc}") from None


def resolve_max_tokens(
    request: inference_pb.GenerateRequest, deployment: deploy_pb.Deployment
) -> None:
    """An unset max_tokens (0) becomes the deployment's max_output_tokens, as OpenAI's
    chat API generates up to the model's limit when no max_tokens is given (a deployment
    that records no limit gets the deployer's default), or the request's
    max_tokens_default where that is fewer (OpenAI's completions: 16)."""
    if not request.max_tokens:
        limit = deployment.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS
        default = request.max_tokens_default
        request.max_tokens = min(limit, default) if default else limit


def prompt_token_limit(
    deployment: deploy_pb.Deployment, max_tokens: int, max_tokens_is_bound: bool
) -> tuple[int, str]:
    """The most prompt tokens a request may have on ``deployment`` (0: no limit is
    recorded) and what the limit is: OpenAI's rule, prompt plus max_tokens within the
    sequence a worker holds (max_input_tokens + max_output_tokens), so that asking for
    fewer tokens leaves a longer prompt room, and max_input_tokens is the prompt room
    left at the longest output. With ``max_tokens_is_bound`` (the client set no
    max_tokens) a prompt may take the whole sequence but one token."""
    prompt_limit, limit = deployment.max_input_tokens, deployment.max_output_tokens
    if not (prompt_limit and limit):
        return prompt_limit, "max_input_tokens"
    sequence = sequence_length(prompt_limit, limit)
    if max_tokens_is_bound:
        return sequence - 1, "max_input_tokens + max_output_tokens - 1, max_tokens being unset"
    if not 0 < max_tokens <= limit:
        return prompt_limit, "max_input_tokens"
    return sequence - max_tokens, "max_input_tokens + max_output_tokens - max_tokens"


def predicted_prompt_tokens(
    request: inference_pb.GenerateRequest,
    deployment: deploy_pb.Deployment,
    max_tokens_is_bound: bool,
    tokens_of_chars: Callable[[int], int],
) -> tuple[int, bool]:
    """The prompt length a queue predicts the request's prefill by, and whether it is a
    text prompt guessed longer than the deployment accepts: its token ids' count, or for
    text the guess ``tokens_of_chars`` makes from its characters, at most the
    deployment's prompt limit. The worker refuses a longer prompt, so no request
    prefills more; and one guessed longer is the worker's to count (it gets the
    worker's 400 for being too long, not a predicted-deadline refusal)."""
    tokens = len(request.prompt_token_ids) or tokens_of_chars(len(request.prompt))
    limit = prompt_token_limit(deployment, request.max_tokens, max_tokens_is_bound)[0]
    if limit and tokens > limit:
        return limit, not request.prompt_token_ids
    return tokens, False


def check_for_deployment(
    request: inference_pb.GenerateRequest,
    deployment: deploy_pb.Deployment,
    max_tokens_is_bound: bool = False,
) -> None:
    """Checks against the deployment's limits (a limit of 0 means none is recorded).
    With ``max_tokens_is_bound`` (the client set none) a prompt may take the whole
    sequence but one token: the worker generates what it leaves, as for a text prompt."""
    limit = deployment.max_output_tokens
    if limit and request.max_tokens > limit:
        raise InvalidArgument(
            f"max_tokens {request.max_tokens} exceeds max_output_tokens {limit} "
            f"of deployment {deployment.deployment_id}"
        )
    prompt_limit, what = prompt_token_limit(deployment, request.max_tokens, max_tokens_is_bound)
    if prompt_limit and len(request.prompt_token_ids) > prompt_limit:
        raise ContextLengthExceeded(
            f"prompt has {len(request.prompt_token_ids)} tokens; deployment "
            f"{deployment.deployment_id} accepts at most {prompt_limit} ({what})"
        )
