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
from prometheus_client import CollectorRegistry

from scheduler_svc.deadlines import decode_alone_passes, first_token_deadline
from scheduler_svc.metrics import FINISH_NAMES, RequestRecord, ServingMetrics
from scheduler_svc.policies import QueueEntry
from scheduler_svc.queues import (
    Clock,
    DeploymentQueue,
    PolicyFactory,
    QueueClosed,
    QueueRegistry,
)
from scheduler_svc.routing import (
    REFRESH_INTERVAL_S,
    Router,
    answered_refusal,
    pinned,
    stats_for_caller,
    unreachable_first,
)
from scheduler_svc.validation import (
    check_for_deployment,
    check_request,
    predicted_prompt_tokens,
    prompt_token_limit,
    resolve_max_tokens,
)
from scheduler_svc.worker_client import WorkerClients, WorkerStream, WorkerStreamError
from services import errors, replicas
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as inference_pb
from services.api import inference_service_pb2_grpc as inference_grpc
from services.api import worker_service_pb2 as worker_pb
from services.drain import InFlight
from services.grpc_server import ServiceBinding, ended_by_client, logged_request_id
from services.ids import new_request_id, replica_group_id
from services.metrics import new_registry
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
# What a deployment answers a request it does not take; a model's request then tries its
# other deployments (SchedulerServicer._admit).
ADMISSION_REFUSALS = (errors.InvalidArgument, errors.ResourceExhausted, errors.DeadlineExceeded)


def removed_before_serving(deployment_id: str) -> str:
    """Why a request routed to ``deployment_id`` (the scheduler's records, refreshed each
    second, still listed it) found its worker stopped and its record deleted."""
    return f"deployment {deployment_id} was removed; its worker stopped before serving the request"


class ReplicaGone(errors.Unavailable):
    """A replica's worker died before the request streamed any token."""

    def __init__(self, message: str, others_serve: bool):
        super().__init__(message)
        self.others_serve = others_serve


class InferenceServicer(inference_grpc.InferenceServiceServicer):
    """Serves ``iserve.v1.InferenceService`` from the deployments recorded in ``store``."""

    def __init__(
        self,
        store: StateStore,
        queue_capacity: int,
        policy_factory: PolicyFactory | None = None,
        clock: Clock = time.perf_counter,
        registry: CollectorRegistry | None = None,
    ):
        self.store = store
        self.queues = QueueRegistry(queue_capacity, policy_factory, clock)
        self.registry = registry if registry is not None else new_registry()
        self.router = Router(store, lambda d: self.queues.shortest_wait(d)[0])
        self.metrics = ServingMetrics(
            self.registry, self.queues.snapshot, self.queues.predictions, self._known_model
        )
        self.workers = WorkerClients()
        self._clock = clock
        # Workers found gone, avoided until their replica leaves the records.
        self._unreachable: set[str] = set()
        # Generate calls in flight; on SIGTERM new ones get UNAVAILABLE (services.drain).
        self.in_flight = InFlight("scheduler")

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

    def _known_model(self, deployment_id: str) -> str:
        record = self.router.cached(deployment_id)
        return record.model_id if record is not None else ""

    async def Generate(
        self, request: inference_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb.GenerateResponse]:
        clock = self._clock
        # Labelled by model and deployment only once resolved: ids a client makes up must
        # not become metric series.
        record = RequestRecord("", request.deadline_ms, clock())
        if not request.request_id:  # one of its own, in every response and log line
            request.request_id = new_request_id()
        rid = request.request_id
        budget_s = context.time_remaining()
        try:
            self.in_flight.admit(context)  # UNAVAILABLE once draining; counted until it ends
            check_request(request)
            # Unset: the deployment's max_output_tokens, as far as the prompt leaves room.
            max_tokens_is_bound = request.max_tokens == 0
            by_model = request.WhichOneof("target") == "model_id"
            # A second attempt only when the replica's worker was gone before any token,
            # or the replica stopped serving while the request waited.
            retried_after = ""  # why the second attempt is made
            waited = False  # whether it waited on a replica that stopped serving
            for attempt in range(2):
                try:
                    deployment, replica, queue, entry = await self._admit(
                        request, record, max_tokens_is_bound
                    )
                except QueueClosed as closed:
                    # Removed or taken out while it waited: routed afresh, it goes to what
                    # serves now, or is told at once why nothing does.
                    if attempt:
                        raise errors.Unavailable(str(closed)) from None
                    retried_after, waited = str(closed), True
                    continue
                except errors.NotFound as missing:
                    if not retried_after:
                        raise
                    if by_model and not pinned(request, record.deployment_id):
                        # Accepted, and the model's deployment was removed since: the
                        # server's state (the gateway's 503), not an unknown model (a
                        # 404 told queued requests the model had never been deployed).
                        why = retried_after
                        if waited:
                            why += ": it was removed while the request waited"
                        raise errors.NotServing(f"{missing} now: {why}") from None
                    # The deployment it was routed to was removed since: not an unknown id.
                    if not waited:
                        raise errors.NotServing(
                            removed_before_serving(record.deployment_id)
                        ) from None
                    raise errors.NotServing(
                        f"{retried_after}: it was removed while the request waited"
                    ) from None
                except errors.ResourceExhausted as full:
                    if not retried_after:
                        raise
                    # The replica it was accepted on is gone and the others are full: say
                    # so, not only "queue full" of a request the client saw accepted.
                    raise errors.ResourceExhausted(
                        f"{full} (tried there after: {retried_after})"
                    ) from None
                # Sequences running beside it, itself included, over its decode: from the
                # queue's occupancy at its first token to its end (the mean of the two
                # counts at admission and end read a wave of 8 that ran together as 4.5).
                decode_from: tuple[float, float] | None = None
                final: worker_pb.WorkerServiceGenerateResponse | None = None
                token_times = record.token_times
                stream: WorkerStream | None = None
                try:
                    # No deadline goes to the worker: when the client's passes, gRPC cancels
                    # this handler and closing the stream cancels the generation.
                    prompt_limit, prompt_rule = prompt_token_limit(
                        deployment, request.max_tokens, max_tokens_is_bound
                    )
                    stream = self.workers.session(replica.worker_address).start(
                        worker_pb.WorkerServiceGenerateRequest(
                            request_id=rid,
                            prompt=request.prompt,
                            prompt_token_ids=request.prompt_token_ids,
                            prompt_has_special_tokens=request.prompt_has_special_tokens,
                            max_tokens=request.max_tokens,
                            max_tokens_is_bound=max_tokens_is_bound,
                            sampling=request.sampling,
                            max_prompt_tokens=prompt_limit,
                            max_prompt_tokens_rule=prompt_rule,
                        )
                    )
                    # Headers now, while the worker computes, so the first token travels
                    # alone; but first let the request to the worker go out (a task writes it).
                    await asyncio.sleep(0)
                    if attempt == 0:
                        await context.send_initial_metadata(())
                    read = stream.read
                    token_time = token_times.append
                    try:
                        while final is None:
                            message = await read()
                            if message.prefilled_with_tokens:
                                record.prefilled_with = message.prefilled_with_tokens
                            if message.prompt_wait_ms > 0:
                                record.prompt_wait_s = message.prompt_wait_ms / 1e3
                            if message.token_ids or message.text:
                                token_time(clock())
                                if decode_from is None:
                                    decode_from = queue.occupancy_mark()
                                yield GenerateResponse(
                                    request_id=rid,
                                    delta=TokenDelta(
                                        token_ids=message.token_ids,
                                        text=message.text,
                                        prompt_tokens=message.prompt_tokens,
                                    ),
                                )
                            if message.finish_reason:
                                final = message
                    except WorkerStreamError as exc:
                        await self._worker_failed(
                            deployment, replica, exc, streamed=bool(token_times)
                        )
                except ReplicaGone as gone:
                    if attempt or not (
                        gone.others_serve
                        or by_model
                        or await self._restarted_elsewhere(request, replica.worker_address)
                    ):
                        raise
                    # Once more: on a replica that still serves, on the worker Redis now
                    # names for it (the cached record was of the one before a restart),
                    # or, for a model's request, on whichever deployment of it Redis now
                    # says is READY (the cached one may have been removed since).
                    retried_after = str(gone)
                    continue
                finally:
                    if stream is not None:
                        stream.close()  # unless it finished: the client went away
                    running = queue.mean_running_since(decode_from)
                    queue.release(entry)
                break
            yield self._finish(request, record, queue, final, running)
        except errors.IServeError as exc:
            record.code = exc.code
            if not record.deployment_id:
                # Refused before it was routed (an empty prompt, say, or a model none of
                # whose deployments is READY while one restarts): still a request the
                # deployment it names, or its model's, failed, as GetServingStats counts
                # them; during an outage most of all.
                named = (
                    self.router.cached(request.deployment_id)
                    if request.HasField("deployment_id")
                    else self.router.refused_for_model(request.model_id)
                )
                if named is not None:
                    self._label(record, named)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: the stream was closed at a yield (the client went away
            # between messages): a cancellation, not a success with no finish reason.
            record.code = ended_by_client(context, budget_s)
            # Hung up, or its call's deadline passed (the client's, not an objective of
            # the request's): missed only if by then it had missed one (a timed-out call
            # whose first token came in 4 ms of a 300 ms TTFT SLO counted as missed).
            record.cancelled_s = clock()
            # As the served ones: an operator reading the log sees each request end.
            log.info(
                "request %s ended by the client (%s) after %d tokens, %.0f ms",
                logged_request_id(request),
                record.code.name,
                len(record.token_times),
                (clock() - record.arrival_s) * 1e3,
            )
            raise
        except Exception:
            record.code = grpc.StatusCode.INTERNAL
            raise
        finally:
            self.metrics.record(record)

    async def GetServingStats(
        self, request: inference_pb.GetServingStatsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb.GetServingStatsResponse:
        shown = stats_for_caller(self.metrics.stats(), self.router.deployments())
        return inference_pb.GetServingStatsResponse(
            request_id=request.request_id,
            deployments=[
                inference_pb.DeploymentServingStats(
                    deployment_id=s.deployment_id,
                    model_id=s.model_id,
                    requests_waiting=s.waiting,
                    requests_running=s.running,
                    requests_completed=s.completed,
                    requests_failed=s.failed,
                    ttft_p50_ms=s.ttft_p50_s * 1e3,
                    ttft_p95_ms=s.ttft_p95_s * 1e3,
                    slo_attained=s.slo_attained,
                    slo_missed=s.slo_missed,
                )
                for s in shown
            ],
        )

    async def _restarted_elsewhere(
        self, request: inference_pb.GenerateRequest, gone_address: str
    ) -> bool:
        """Whether the deployment ``request`` names, read afresh, serves on a worker other
        than ``gone_address`` (the router's cached record was of one restarted since).
        FAILED_PRECONDITION when it was removed since, as for a request that waited on it,
        not the NOT_FOUND of an id that never was; the removal explains the worker's going,
        so the client is not shown the connection's error."""
        try:
            fresh = await self.router.by_deployment_id(request.deployment_id)
        except errors.NotFound:
            raise errors.NotServing(removed_before_serving(request.deployment_id)) from None
        return any(r.worker_address != gone_address for r in replicas.serving(fresh))

    async def _admit(
        self,
        request: inference_pb.GenerateRequest,
        record: RequestRecord,
        max_tokens_is_bound: bool,
    ) -> tuple[deploy_pb.Deployment, deploy_pb.Replica, DeploymentQueue, QueueEntry]:
        """Resolve the request's deployment and replica and wait for a slot on it; fills
        ``record``. The caller releases the slot. ``max_tokens_is_bound``: the client set
        no max_tokens (it is filled in here, from the deployment that takes it).

        A model's request goes to its READY deployments in turn, shortest expected wait
        first, until one takes it: one that refuses it at admission (its limits, a full
        queue, a first token its EDF queue predicts late) leaves it to the next. When all
        refuse, :func:`answered_refusal` says which refusal is raised and recorded. A
        request whose own deadline a deployment finds unreachable goes there first
        (:func:`unreachable_first`), and one that can predict nothing repeats that
        refusal."""
        if request.HasField("deployment_id"):
            candidates = [await self.router.by_deployment_id(request.deployment_id)]
        else:
            candidates = unreachable_first(
                await self.router.ranked_for_model(request.model_id),
                request,
                max_tokens_is_bound,
                record.arrival_s,
                self._fastest_decode_s,
            )
        refusals: list[tuple[deploy_pb.Deployment, errors.IServeError]] = []
        unreachable: errors.DeadlineUnreachable | None = None
        for deployment in candidates:
            try:
                return await self._admit_to(
                    deployment, request, record, max_tokens_is_bound, unreachable
                )
            except ADMISSION_REFUSALS as refused:
                refusals.append((deployment, refused))
                if isinstance(refused, errors.DeadlineUnreachable) and unreachable is None:
                    unreachable = refused
        assert refusals  # the router names at least one deployment
        deployment, refused = answered_refusal(refusals, own_deadline=request.deadline_ms > 0)
        self._label(record, deployment)
        raise refused

    def _fastest_decode_s(self, deployment: deploy_pb.Deployment) -> float | None:
        """The decode step alone of ``deployment``'s best informed replica, None when
        it has measured nothing (nor has an estimate)."""
        predictor = self.queues.best_informed(deployment)
        if predictor is None or not predictor.evidence:
            return None
        return predictor.decode_step_s(1)

    def _label(self, record: RequestRecord, deployment: deploy_pb.Deployment) -> None:
        record.model_id = deployment.model_id
        record.deployment_id = deployment.deployment_id
        self.metrics.seen(deployment.deployment_id, deployment.model_id)
        record.objectives = deployment.objectives

    async def _admit_to(
        self,
        deployment: deploy_pb.Deployment,
        request: inference_pb.GenerateRequest,
        record: RequestRecord,
        max_tokens_is_bound: bool,
        unreachable: errors.DeadlineUnreachable | None = None,
    ) -> tuple[deploy_pb.Deployment, deploy_pb.Replica, DeploymentQueue, QueueEntry]:
        """:meth:`_admit` on ``deployment``; ``unreachable``: another deployment of the
        model found the request's deadline so, which this one repeats when it has no
        measurement of its own to judge by."""
        clock = self._clock
        arrival = record.arrival_s
        self._label(record, deployment)
        if max_tokens_is_bound:
            request.max_tokens = 0  # filled in by the deployment tried before
        resolve_max_tokens(request, deployment)
        check_for_deployment(request, deployment, max_tokens_is_bound)
        # Until the deployer takes them out (routing refreshes each second).
        deployment = replicas.avoiding(deployment, self._unreachable)
        self.queues.set_serving(deployment)
        replica = self._replica_for(deployment)
        queue = self.queues.queue_for(deployment, replica.index)
        predictor = queue.predictor
        # The replicas run one configuration: the one that knows most judges a deadline.
        judge = self.queues.best_informed(deployment) or predictor
        if unreachable is not None and not judge.evidence:
            raise unreachable
        prompt_tokens, guessed_too_long = predicted_prompt_tokens(
            request, deployment, max_tokens_is_bound, predictor.prompt_tokens
        )
        # An FCFS queue checks no objective of the deployment's: only a request's own
        # deadline, and only when it came by model (see refused_if_late).
        objectives = deployment.objectives if queue.edf else common.ServiceObjectives()
        due = first_token_deadline(
            arrival,
            objectives,
            request.deadline_ms,
            request.max_tokens,
            # Its decode runs beside at most a batch of others, however many wait.
            judge.decode_step_s(min(queue.running + 1, queue.slots)),
        )
        entry = QueueEntry(
            request.request_id,
            arrival,
            priority=request.priority,
            deadline_s=due.first_token_s,
            prompt_tokens=prompt_tokens,
            max_tokens=request.max_tokens,
            objective=due.objective,
            # By model, the scheduler picks where a request goes: one with a deadline of
            # its own goes only where its first token is predicted in time. An FCFS
            # deployment checks that at admission too, so a request EDF found hopeless
            # is not served late, with success, by an FCFS deployment of the model; by
            # deployment id, FCFS serves what it takes, however late.
            refused_if_late=request.deadline_ms > 0
            and not pinned(request, deployment.deployment_id),
            not_refused_late=guessed_too_long,
            # Decoded alone, at the fastest this deployment decodes: due before it came?
            unreachable=decode_alone_passes(
                arrival, objectives, request.deadline_ms, request.max_tokens, judge.decode_step_s(1)
            ),
        )
        if entry.unreachable and judge.service_measured and not predictor.service_measured:
            # This replica's queue predicts no miss before a request has finished on it;
            # its sibling's measurements say no queue could meet this one.
            raise queue.unreachable_refusal(entry, arrival + judge.prefill_s([prompt_tokens]))
        self.queues.check_room(deployment)
        if record.enqueued_s is None:  # a request moved on keeps its first queue's wait
            record.enqueued_s = clock()
        holder = await queue.acquire(entry)
        record.admitted_s = clock()
        if holder is not queue:
            # Another replica freed a slot first and took the request from this queue: it
            # serves in the scheduler's newest view (the request's own record may be of
            # before that replica's restart, seconds ago).
            newest = self.router.cached(deployment.deployment_id) or deployment
            newest = replicas.avoiding(newest, self._unreachable)
            taken = [r for r in replicas.serving(newest) if r.index == holder.replica_index]
            if not taken or not taken[0].worker_address:
                # Not serving in this request's view of the records (they changed since):
                # routed afresh once, like a request whose replica stopped serving.
                holder.release(entry)
                raise QueueClosed(
                    f"replica {holder.replica_index} of deployment {deployment.deployment_id} "
                    "stopped serving"
                )
            replica, queue = taken[0], holder
        return deployment, replica, queue, entry

    def _finish(
        self,
        request: inference_pb.GenerateRequest,
        record: RequestRecord,
        queue: DeploymentQueue,
        final: worker_pb.WorkerServiceGenerateResponse,
        running: float,
    ) -> inference_pb.GenerateResponse:
        """The final message with the scheduler's timings; the deployment's predictor
        learns from them (``running``: the sequences beside it, itself included)."""
        done = self._clock()
        arrival, admitted, token_times = record.arrival_s, record.admitted_s, record.token_times
        record.prompt_tokens = final.usage.prompt_tokens
        record.completion_tokens = final.usage.completion_tokens
        record.finish_reason = final.finish_reason
        deltas = len(token_times)
        first_at = token_times[0] if deltas else admitted
        tpot_s = (token_times[-1] - first_at) / (deltas - 1) if deltas > 1 else None
        timings = common.Timings(
            queue_ms=(admitted - record.enqueued_s) * 1e3,
            ttft_ms=(first_at - arrival) * 1e3 if deltas else 0.0,
            tpot_ms=tpot_s * 1e3 if tpot_s is not None else 0.0,
            total_ms=(done - arrival) * 1e3,
        )
        if deltas:
            queue.predictor.observe(
                prompt_tokens=final.usage.prompt_tokens,
                prefilled_tokens=record.prefilled_with,
                prompt_chars=0 if request.prompt_token_ids else len(request.prompt),
                # Less the prompt's wait behind others for the worker's encoding thread:
                # queueing there is not prefill, and learnt as such it refused normal
                # requests on an idle deployment afterwards.
                first_token_s=max(0.0, first_at - admitted - record.prompt_wait_s),
                tpot_s=tpot_s,
                running=running,
                service_s=token_times[-1] - admitted,
                output_share=final.usage.completion_tokens / request.max_tokens,
            )
        # One line per request served, naming the replica that served it (a request can
        # move to the replica that frees first), as a serving system's access log does.
        log.info(
            "request %s served by %s: %d prompt + %d tokens (%s), queue %.0f ms, "
            "TTFT %.0f ms, total %.0f ms",
            request.request_id,
            queue.described,
            final.usage.prompt_tokens,
            final.usage.completion_tokens,
            FINISH_NAMES.get(final.finish_reason, "unknown"),
            timings.queue_ms,
            timings.ttft_ms,
            timings.total_ms,
        )
        return GenerateResponse(
            request_id=request.request_id,
            final=inference_pb.GenerateFinal(
                finish_reason=final.finish_reason,
                usage=final.usage,
                timings=timings,
                deployment_id=record.deployment_id,
            ),
        )

    def _replica_for(self, deployment: deploy_pb.Deployment) -> deploy_pb.Replica:
        """The serving replica with the shortest expected wait (the only one, without
        weighing waits, when one serves)."""
        serving = replicas.serving(deployment)
        if not serving:
            raise errors.NotServing(f"deployment {deployment.deployment_id} has no replica serving")
        if len(serving) == 1:
            replica = serving[0]
        else:
            index = self.queues.choose_replica(deployment)
            replica = next(r for r in serving if r.index == index)
        if not replica.worker_address:
            raise errors.NotServing(
                f"deployment {deployment.deployment_id} is READY but replica "
                f"{replica.index} names no worker address"
            )
        return replica

    async def _worker_failed(
        self,
        deployment: deploy_pb.Deployment,
        replica: deploy_pb.Replica,
        exc: WorkerStreamError,
        streamed: bool,
    ) -> NoReturn:
        code, details = exc.code, exc.details
        if code in GONE_CODES:
            await self._worker_gone(deployment, replica, f"{code.name}: {details}", streamed)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            refused = errors.InvalidArgument(details)
            refused.reason = exc.reason  # what the client may act on (context length)
            raise refused
        error = PASSED_THROUGH.get(code, errors.IServeError)
        raise error(
            f"worker of deployment {deployment.deployment_id} failed: {code.name}: {details}"
        )

    async def _worker_gone(
        self,
        deployment: deploy_pb.Deployment,
        replica: deploy_pb.Replica,
        reason: str,
        streamed: bool,
    ) -> NoReturn:
        """Report the replica's worker as unreachable (the deployer takes the replica out,
        or fails the deployment when it was the last) and fail the request with
        UNAVAILABLE."""
        deployment_id = deployment.deployment_id
        self.router.forget(deployment_id)
        self._unreachable.add(replica.worker_address)
        # Its queue takes no more requests waiting on the other replicas.
        self.queues.set_serving(replicas.avoiding(deployment, self._unreachable))
        try:
            await asyncio.wait_for(
                self.store.publish_event(
                    "worker_unreachable",
                    deployment_id=replica_group_id(deployment_id, replica.index),
                    worker_address=replica.worker_address,
                    reason=reason,
                ),
                EVENT_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001 - the client still gets its error
            log.warning("cannot publish worker_unreachable for %s: %s", deployment_id, exc)
        message = f"worker of deployment {deployment_id} is gone: {reason}"
        if not streamed:
            others = [r for r in replicas.serving(deployment) if r.index != replica.index]
            raise ReplicaGone(message, others_serve=bool(others))
        raise errors.Unavailable(message)

    async def _forget_removed(self, deployments: list[deploy_pb.Deployment]) -> None:
        serving = [(d, r) for d in deployments for r in replicas.serving(d)]
        self.queues.prune(
            (replica_group_id(d.deployment_id, r.index) for d, r in serving),
            # Being removed: its waiting requests are told at once, not a refresh later.
            removing=(
                d.deployment_id
                for d in deployments
                if d.state == deploy_pb.DEPLOYMENT_STATE_REMOVING
            ),
        )
        self.metrics.forget(d.deployment_id for d in deployments)
        addresses = {r.worker_address for _, r in serving if r.worker_address}
        self._unreachable &= addresses  # taken out of the records: nothing left to avoid
        for deployment in deployments:
            # Replicas back in service take requests waiting on the others at once.
            self.queues.serving_now(replicas.avoiding(deployment, self._unreachable))
        await self.workers.retain(addresses)
