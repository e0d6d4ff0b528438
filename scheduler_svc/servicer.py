"""InferenceService: protobuf in, tokens out.

``Generate`` checks the request, resolves its deployment (``routing``), waits for a slot
(``queues``), streams the worker's tokens through and ends with the scheduler's own
timings. The request reaches the worker as one message on the worker's open session
(``worker_client``), not as a new call. The token loop is the hot path: one response
message per worker message, no logging, no Redis, one clock read per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from scheduler_svc.deadlines import first_token_deadline
from scheduler_svc.policies import QueueEntry
from scheduler_svc.queues import Clock, PolicyFactory, QueueRegistry
from scheduler_svc.routing import REFRESH_INTERVAL_S, Router
from scheduler_svc.validation import check_for_deployment, check_request
from scheduler_svc.worker_client import WorkerClients, WorkerStream, WorkerStreamError
from services import errors
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as inference_pb
from services.api import inference_service_pb2_grpc as inference_grpc
from services.api import worker_service_pb2 as worker_pb
from services.grpc_server import ServiceBinding
from services.state.store import StateStore

log = logging.getLogger("iserve.scheduler")

GenerateResponse = inference_pb.GenerateResponse
TokenDelta = inference_pb.TokenDelta

# Worker statuses meaning the worker itself is gone (crashed, stopped, unreachable).
GONE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# Worker statuses passed to the client with the same code.
PASSED_THROUGH = {
    cls.code: cls
    for cls in (
        errors.InvalidArgument,
        errors.FailedPrecondition,
        errors.ResourceExhausted,
        errors.DeadlineExceeded,
    )
}
EVENT_TIMEOUT_S = 1.0


class InferenceServicer(inference_grpc.InferenceServiceServicer):
    """Serves ``iserve.v1.InferenceService`` from the deployments recorded in ``store``."""

    def __init__(
        self,
        store: StateStore,
        queue_capacity: int,
        policy_factory: PolicyFactory | None = None,
        clock: Clock = time.perf_counter,
    ):
        self.store = store
        self.queues = QueueRegistry(queue_capacity, policy_factory, clock)
        self.router = Router(store, self.queues.backlog)
        self.workers = WorkerClients()
        self._clock = clock

    def binding(self) -> ServiceBinding:
        return ServiceBinding(
            self,
            inference_grpc.add_InferenceServiceServicer_to_server,
            "iserve.v1.InferenceService",
        )

    async def refresh_forever(self, interval_s: float = REFRESH_INTERVAL_S) -> None:
        """Background task: keep the deployment cache fresh and drop what is gone."""
        await self.router.refresh_forever(interval_s, self._forget_removed)

    async def close(self) -> None:
        await self.workers.close()

    async def Generate(
        self, request: inference_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb.GenerateResponse]:
        clock = self._clock
        arrival = clock()
        check_request(request)
        if request.HasField("deployment_id"):
            deployment = await self.router.by_deployment_id(request.deployment_id)
        else:
            deployment = await self.router.by_model_id(request.model_id)
        check_for_deployment(request, deployment)
        if not deployment.worker_address:
            raise errors.FailedPrecondition(
                f"deployment {deployment.deployment_id} is READY but names no worker address"
            )

        deployment_id = deployment.deployment_id
        queue = self.queues.queue_for(deployment)
        predictor = queue.predictor
        prompt_tokens = len(request.prompt_token_ids) or predictor.prompt_tokens(
            len(request.prompt)
        )
        due = first_token_deadline(
            arrival,
            deployment.objectives,
            request.deadline_ms,
            request.max_tokens,
            predictor.decode_step_s(queue.running + 1),
        )
        entry = QueueEntry(
            request.request_id,
            arrival,
            request.priority,
            due.first_token_s,
            prompt_tokens,
            due.objective,
        )
        enqueued = clock()
        await queue.acquire(entry)
        admitted = clock()

        rid = request.request_id
        final: worker_pb.WorkerServiceGenerateResponse | None = None
        token_times: list[float] = []
        stream: WorkerStream | None = None
        try:
            # No deadline goes to the worker: when the client's passes, gRPC cancels this
            # handler and closing the stream cancels the generation.
            stream = self.workers.session(deployment.worker_address).start(
                worker_pb.WorkerServiceGenerateRequest(
                    request_id=rid,
                    prompt=request.prompt,
                    prompt_token_ids=request.prompt_token_ids,
                    max_tokens=request.max_tokens,
                    sampling=request.sampling,
                )
            )
            # Headers now, while the worker computes, so the first token travels alone; but
            # first let the request to the worker go out (its write runs in a task).
            await asyncio.sleep(0)
            await context.send_initial_metadata(())
            read = stream.read
            token_time = token_times.append
            try:
                while final is None:
                    message = await read()
                    if message.token_ids or message.text:
                        token_time(clock())
                        yield GenerateResponse(
                            request_id=rid,
                            delta=TokenDelta(token_ids=message.token_ids, text=message.text),
                        )
                    if message.finish_reason:
                        final = message
            except WorkerStreamError as exc:
                await self._worker_failed(deployment, exc)
        finally:
            if stream is not None:
                stream.close()  # unless it finished: the client went away, stop the worker
            queue.release()

        done = clock()
        deltas = len(token_times)
        first_at = token_times[0] if deltas else admitted
        tpot_s = (token_times[-1] - first_at) / (deltas - 1) if deltas > 1 else None
        timings = common.Timings(
            queue_ms=(admitted - enqueued) * 1e3,
            ttft_ms=(first_at - arrival) * 1e3 if deltas else 0.0,
            tpot_ms=tpot_s * 1e3 if tpot_s is not None else 0.0,
            total_ms=(done - arrival) * 1e3,
        )
        if deltas:
            predictor.observe(
                prompt_tokens=final.usage.prompt_tokens,
                prompt_chars=0 if request.prompt_token_ids else len(request.prompt),
                first_token_s=first_at - admitted,
                tpot_s=tpot_s,
                running=queue.running + 1,
            )
        yield GenerateResponse(
            request_id=rid,
            final=inference_pb.GenerateFinal(
                finish_reason=final.finish_reason,
                usage=final.usage,
                timings=timings,
                deployment_id=deployment_id,
            ),
        )

    async def _worker_failed(
        self, deployment: deploy_pb.Deployment, exc: WorkerStreamError
    ) -> NoReturn:
        code, details = exc.code, exc.details
        if code in GONE_CODES:
            await self._worker_gone(deployment, f"{code.name}: {details}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise errors.InvalidArgument(details)
        error = PASSED_THROUGH.get(code, errors.IServeError)
        raise error(
            f"worker of deployment {deployment.deployment_id} failed: {code.name}: {details}"
        )

    async def _worker_gone(self, deployment: deploy_pb.Deployment, reason: str) -> NoReturn:
        """Report the worker as unreachable (the deployer marks the deployment failed) and
        fail the request with UNAVAILABLE."""
        deployment_id = deployment.deployment_id
        self.router.forget(deployment_id)
        try:
            await asyncio.wait_for(
                self.store.publish_event(
                    "worker_unreachable",
                    deployment_id=deployment_id,
                    worker_address=deployment.worker_address,
                    reason=reason,
                ),
                EVENT_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001 - the client still gets its error
            log.warning("cannot publish worker_unreachable for %s: %s", deployment_id, exc)
        raise errors.Unavailable(f"worker of deployment {deployment_id} is gone: {reason}")

    async def _forget_removed(self, deployments: list[deploy_pb.Deployment]) -> None:
        self.queues.prune(d.deployment_id for d in deployments)
        await self.workers.retain(d.worker_address for d in deployments if d.worker_address)
