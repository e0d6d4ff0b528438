"""WorkerService: protobuf in, EngineRunner, protobuf out.

Generate serves one generation per call; Session serves many over one stream
(:mod:`monitor_agent.worker.session`, what the scheduler uses); both run ``_generate``.

Both refuse new generations with UNAVAILABLE once the worker drains (on SIGTERM, see
:mod:`services.drain`): the generations in flight are counted here, not the calls,
because the scheduler's Session call stays open for as long as the worker lives.

GetWorkerStats reports the engine's memory account (weights + KV cache + measured peak
activations, see monitor_agent.engine.memory) as resident_bytes, and as peak_memory_bytes
whatever the worker's probe measures (the same account on CPU, the CUDA allocator's peak
on GPUs).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from monitor_agent.engine.batching import GenerationRequest
from monitor_agent.engine.distributed import GroupLost
from monitor_agent.engine.engine import SamplingConfig
from monitor_agent.engine.layer_clock import LayerClock
from monitor_agent.worker.runner import EngineRunner, RequestClock
from monitor_agent.worker.session import serve_session
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.drain import InFlight
from services.errors import ContextLengthExceeded, InvalidArgument, Unavailable, require
from services.models.special_tokens import PromptTooLong

FINISH_REASONS = {"length": common.FINISH_REASON_LENGTH, "stop": common.FINISH_REASON_STOP}
# Text prompts up to this many characters are encoded in a thread of their own: a few
# milliseconds' work at most, which never waits behind a long prompt's.
SHORT_PROMPT_CHARS = 16_384
# Characters of a caller's max_prompt_tokens_rule a refusal repeats.
MAX_RULE_CHARS = 200


@dataclass(frozen=True)
class WorkerIdentity:
    deployment_id: str
    rank: int


def sampling_config(params: common.SamplingParams) -> SamplingConfig:
    """The engine's SamplingConfig for ``params``; InvalidArgument on bad values."""
    try:
        return SamplingConfig(
            temperature=float(params.temperature),
            top_k=int(params.top_k),
            top_p=float(params.top_p) if params.top_p != 0 else 1.0,  # 0: unset
            seed=int(params.seed) if params.HasField("seed") else None,
            stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            stop_strings=tuple(params.stop),
        )
    except ValueError as exc:
        raise InvalidArgument(f"sampling: {exc}") from exc


class WorkerServicer(worker_service_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        runner: EngineRunner,
        identity: WorkerIdentity,
        *,
        peak_memory_bytes: Callable[[], int],
    ):
        self.runner = runner
        self.identity = identity
        self.peak_memory_bytes = peak_memory_bytes
        self.in_flight = InFlight(f"worker of deployment {identity.deployment_id}")
        # Text prompts are encoded off the event loop: a tokenizer takes a second on
        # half a megabyte of text, which on the loop froze every other stream of this
        # worker. Short prompts have a thread of their own, so that one client's long
        # ones (which the encoder reads only as far as it takes to refuse them) do not
        # hold up everyone's first tokens.
        self._encoders = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode-short"),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode-long"),
        )

    def _parse(self, request: worker_pb.WorkerServiceGenerateRequest) -> GenerationRequest:
        """The engine's request for ``request``, checked once; InvalidArgument saying what
        to fix."""
        sampling = sampling_config(request.sampling)
        try:
            if request.prompt_token_ids:
                prompt_ids = list(request.prompt_token_ids)
            else:
                require(bool(request.prompt), "prompt is empty: set prompt or prompt_token_ids")
                prompt_ids = self.runner.engine.encode(
                    request.prompt,
                    add_special_tokens=not request.prompt_has_special_tokens,
                    max_tokens=request.max_prompt_tokens,
                )
            limit = request.max_prompt_tokens
            if limit and len(prompt_ids) > limit:
                raise ContextLengthExceeded(
                    f"prompt has {len(prompt_ids)} tokens; {self._accepts(request)}"
                )
            return self.runner.parse(
                prompt_ids, request.max_tokens, sampling, request.max_tokens_is_bound
            )
        except PromptTooLong as exc:
            # As a counted prompt over the limit: clients trim on this reason.
            if not exc.chars_read:
                raise ContextLengthExceeded(f"{exc}; {self._accepts(request)}") from exc
            raise ContextLengthExceeded(
                f"prompt has more than {exc.limit} tokens (its first {exc.chars_read} of "
                f"{exc.chars} characters alone encode to {exc.counted}); "
                f"{self._accepts(request)}"
            ) from exc
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc

    def _accepts(self, request: worker_pb.WorkerServiceGenerateRequest) -> str:
        """What the deployment accepts, for a refusal: "deployment D accepts at most N
        (rule)"."""
        limit = request.max_prompt_tokens or self.runner.engine.max_seq_len
        rule = request.max_prompt_tokens_rule[:MAX_RULE_CHARS]
        return f"deployment {self.identity.deployment_id} accepts at most {limit}" + (
            f" ({rule})" if rule else ""
        )

    async def _parsed(
        self,
        request: worker_pb.WorkerServiceGenerateRequest,
        stop: threading.Event,
        clock: RequestClock,
    ) -> GenerationRequest | None:
        """:meth:`_parse`, a text prompt's in an encoding thread (its wait there, behind
        other prompts, goes in ``clock.prompt_wait_s``); None when the request was
        cancelled while its prompt waited (a list's other prompts, once one is refused,
        are not encoded for nothing)."""
        if request.prompt_token_ids or not request.prompt:
            return self._parse(request)
        queued = time.perf_counter()

        def parse() -> GenerationRequest | None:
            clock.prompt_wait_s = time.perf_counter() - queued
            return None if stop.is_set() else self._parse(request)

        encoder = self._encoders[len(request.prompt) > SHORT_PROMPT_CHARS]
        return await asyncio.get_running_loop().run_in_executor(encoder, parse)

    async def Generate(
        self, request: worker_pb.WorkerServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb.WorkerServiceGenerateResponse]:
        stop = threading.Event()
        # Fires on cancellation even if the stream is parked between messages.
        context.add_done_callback(lambda _context: stop.set())
        async for response in self._generate(request, stop):
            yield response

    async def Session(
        self,
        request_iterator: AsyncIterator[worker_pb.WorkerServiceSessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await serve_session(request_iterator, context, self._generate)

    async def _generate(
        self,
        request: worker_pb.WorkerServiceGenerateRequest,
        stop: threading.Event | None = None,
    ) -> AsyncIterator[worker_pb.WorkerServiceGenerateResponse]:
        """One generation's responses, the last with finish reason, usage and timings.

        Setting ``stop`` or closing the generator ends it at the engine's next step.
        InvalidArgument for a request the engine cannot run; Unavailable when another
        rank of this deployment died or the worker is draining.
        """
        self.in_flight.enter()
        try:
            clock = RequestClock()
            if stop is None:
                stop = threading.Event()
            generation = await self._parsed(request, stop, clock)
            if generation is None:
                return
            request_id = request.request_id
            async for step in self.runner.generate(generation, stop, clock):
                clock.token()
                response = worker_pb.WorkerServiceGenerateResponse(
                    request_id=request_id, token_ids=[step.token_id], text=step.text
                )
                if clock.tokens == 1:
                    response.prompt_tokens = len(generation.prompt_ids)
                    response.prefilled_with_tokens = clock.prefilled_with
                    response.prompt_wait_ms = clock.prompt_wait_s * 1e3
                if step.finished:
                    response.finish_reason = FINISH_REASONS[step.finish_reason]
                    response.usage.prompt_tokens = len(generation.prompt_ids)
                    response.usage.completion_tokens = clock.tokens
                    timings = response.timings
                    timings.queue_ms = clock.queue_ms
                    timings.ttft_ms = clock.ttft_ms
                    timings.tpot_ms = clock.tpot_ms
                    timings.total_ms = clock.total_ms()
                yield response
        except GroupLost as exc:  # another rank of this deployment died; so will this one
            raise Unavailable(f"worker gone: {exc}") from exc
        finally:
            self.in_flight.leave()

    async def GetWorkerStats(
        self, request: worker_pb.GetWorkerStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb.GetWorkerStatsResponse:
        runner = self.runner
        clock = runner.engine.layer_clock or LayerClock()
        return worker_pb.GetWorkerStatsResponse(
            request_id=request.request_id,
            deployment_id=self.identity.deployment_id,
            rank=self.identity.rank,
            resident_bytes=runner.engine.memory.resident_bytes,
            peak_memory_bytes=self.peak_memory_bytes(),
            requests_served=runner.requests_served,
            tokens_generated=runner.tokens_generated,
            busy_seconds=runner.busy_seconds,
            active_requests=runner.active_requests,
            prefill_layer_seconds=clock.prefill_seconds,
            prefill_layer_passes=clock.prefill_layer_passes,
            decode_layer_seconds=clock.decode_seconds,
            decode_layer_passes=clock.decode_layer_passes,
        )
