"""The scheduler's InferenceService on a real gRPC port, against a real redis-server and
a fake WorkerService (also on a real port) that streams scripted tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from monitor_agent.worker.session import serve_session
from scheduler_svc.servicer import InferenceServicer
from services.aio import cancel_and_wait
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as inference_pb
from services.api import inference_service_pb2_grpc as inference_grpc
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc as worker_grpc
from services.errors import RemoteError
from services.grpc_server import ServiceBinding, channel, ended_by_client, start_server
from services.ports import free_port
from services.state import keys
from services.state.store import StateStore

READY = deploy_pb.DEPLOYMENT_STATE_READY
TOKENS = [(11, "Hel"), (12, "lo"), (13, " world")]
WAIT_S = 5.0


@dataclass
class FakeWorker(worker_grpc.WorkerServiceServicer):
    """Streams ``tokens`` one message each, then a final LENGTH message, over the real
    worker-side session code (``serve_session``).

    ``before_first``: wait for it before the first token. ``gate``: wait for it after the
    first token. ``steps``: take an item from it before each token after the first.
    ``hang``: after the first token, never finish. ``abort``: fail at once with this (code, details). ``final``: whether to
    send the final message. ``prompt_wait_s``: sleep this long before the first token,
    saying the prompt waited that long for the worker's encoding thread.
    """

    tokens: list[tuple[int, str]] = field(default_factory=lambda: list(TOKENS))
    token_delay_s: float = 0.0
    before_first: asyncio.Event | None = None
    gate: asyncio.Event | None = None
    steps: asyncio.Queue | None = None
    hang: bool = False
    abort: tuple[grpc.StatusCode, str] | None = None
    final: bool = True
    prompt_wait_s: float = 0.0
    received: list[worker_pb.WorkerServiceGenerateRequest] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    sessions: int = 0

    async def Session(self, request_iterator, context):
        self.sessions += 1
        await serve_session(request_iterator, context, self.script)

    async def script(self, request):
        self.received.append(request)
        if self.abort is not None:
            raise RemoteError(*self.abort)
        try:
            if self.before_first is not None:
                await self.before_first.wait()
            await asyncio.sleep(self.prompt_wait_s)
            for i, (token_id, text) in enumerate(self.tokens):
                if i:
                    await asyncio.sleep(self.token_delay_s)
                    if self.steps is not None:
                        await self.steps.get()
                yield worker_pb.WorkerServiceGenerateResponse(
                    request_id=request.request_id,
                    token_ids=[token_id],
                    text=text,
                    prompt_wait_ms=self.prompt_wait_s * 1e3 if i == 0 else 0.0,
                )
                if i == 0:
                    if self.gate is not None:
                        await self.gate.wait()
                    if self.hang:
                        await asyncio.Event().wait()
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.set()
            raise
        if self.final:
            yield worker_pb.WorkerServiceGenerateResponse(
                request_id=request.request_id,
                finish_reason=common.FINISH_REASON_LENGTH,
                usage=common.Usage(
                    prompt_tokens=len(request.prompt_token_ids) or 4,
                    completion_tokens=len(self.tokens),
                ),
                timings=common.Timings(ttft_ms=1.0),
            )


@dataclass
class Harness:
    store: StateStore
    servicer: InferenceServicer
    client: inference_grpc.InferenceServiceStub
    workers: dict[str, grpc.aio.Server]

    async def add_deployment(
        self,
        deployment_id: str,
        worker: FakeWorker | None,
        *,
        state: int = READY,
        reason: str = "",
        model_id: str = "m",
        batch_size: int = 1,
        max_output_tokens: int = 16,
        **record,
    ) -> deploy_pb.Deployment:
        if worker is None:  # a port nothing listens on
            address = f"127.0.0.1:{free_port()}"
        else:
            binding = ServiceBinding(
                worker, worker_grpc.add_WorkerServiceServicer_to_server, "iserve.v1.WorkerService"
            )
            server, port, _ = await start_server([binding], "127.0.0.1:0")
            self.workers[deployment_id] = server
            address = f"127.0.0.1:{port}"
        deployment = deploy_pb.Deployment(
            deployment_id=deployment_id,
            model_id=model_id,
            config=common.DeploymentConfig(batch_size=batch_size),
            state=state,
            state_reason=reason,
            worker_address=address,
            max_output_tokens=max_output_tokens,
            **record,
        )
        await self.store.put_deployment(deployment)
        return deployment

    def generate(self, **fields) -> grpc.aio.UnaryStreamCall:
        fields.setdefault("request_id", "r1")
        fields.setdefault("prompt", "hello")
        fields.setdefault("max_tokens", 3)
        return self.client.Generate(inference_pb.GenerateRequest(**fields))

    async def collect(self, **fields) -> list[inference_pb.GenerateResponse]:
        return [message async for message in self.generate(**fields)]

    async def status_of(self, **fields) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await self.collect(**fields)
        return failure.value

    async def until(self, condition, what: str) -> None:
        """Poll ``condition`` until it holds; fail naming ``what`` after WAIT_S."""
        try:
            async with asyncio.timeout(WAIT_S):
                while not condition():
                    await asyncio.sleep(0.005)
        except TimeoutError:
            pytest.fail(f"timed out waiting for {what}")

    async def close_left_out(self) -> None:
        """Refresh the router twice and close the queues of the deployments Redis no
        longer has serving (a replica left out twice in a row is closed)."""
        router = self.servicer.router
        for _ in range(2):
            await router.refresh()
            await self.servicer._forget_removed(router.deployments())

    async def mark_removing(self, deployment: deploy_pb.Deployment) -> None:
        """Record ``deployment`` REMOVING and let the scheduler see it: one refresh (a
        record that says REMOVING closes its queues at once)."""
        deployment.state = deploy_pb.DEPLOYMENT_STATE_REMOVING
        await self.store.put_deployment(deployment)
        router = self.servicer.router
        await router.refresh()
        await self.servicer._forget_removed(router.deployments())

    async def until_waiting(self, deployment_id: str, count: int) -> None:
        queue = self.servicer.queues.get(deployment_id)
        await self.until(lambda: queue.waiting == count, f"{count} waiting on {deployment_id}")


@contextlib.asynccontextmanager
async def harness(
    redis_url: str, queue_capacity: int = 8, clock: Callable[[], float] | None = None
) -> AsyncIterator[Harness]:
    store = StateStore.from_url(redis_url)
    await store.redis.flushdb()
    if clock is None:
        servicer = InferenceServicer(store, queue_capacity)
    else:
        servicer = InferenceServicer(store, queue_capacity, clock=clock)
    server, port, _ = await start_server([servicer.binding()], "127.0.0.1:0")
    chan = channel(f"127.0.0.1:{port}")
    h = Harness(store, servicer, inference_grpc.InferenceServiceStub(chan), {})
    try:
        yield h
    finally:
        await chan.close()
        await server.stop(0)
        for worker_server in h.workers.values():
            await worker_server.stop(0)
        await servicer.close()
        await store.close()


def run(redis_url: str, scenario, **options) -> None:
    async def main():
        async with harness(redis_url, **options) as h:
            await scenario(h)

    asyncio.run(main())


class ManualClock:
    """The scheduler's clock, moved on only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_tokens_are_forwarded_in_order_then_final_with_timings(redis_url):
    # The scheduler times each token as it receives it. On a manual clock, moved on only
    # once the previous token has reached the client (so the scheduler has timed it), the
    # worker's first token comes 5 ms after the request and the others 20 ms apart
    # whatever else the machine is doing.
    clock = ManualClock()

    async def scenario(h: Harness):
        worker = FakeWorker(before_first=asyncio.Event(), steps=asyncio.Queue())
        await h.add_deployment("d1", worker)
        call = h.generate(
            request_id="req-7",
            deployment_id="d1",
            prompt_token_ids=[1, 2],
            max_tokens=3,
            sampling=common.SamplingParams(temperature=0.5, top_p=0.9, top_k=4),
        )
        await h.until(lambda: worker.received, "the request reached the worker")
        clock.advance(0.005)
        worker.before_first.set()
        messages = [await call.read()]
        for _ in TOKENS[1:]:
            clock.advance(0.020)
            worker.steps.put_nowait(None)
            messages.append(await call.read())
        messages += await read_rest(call)
        assert {m.request_id for m in messages} == {"req-7"}
        deltas = [m.delta for m in messages[:-1]]
        assert [(list(d.token_ids), d.text) for d in deltas] == [([t], s) for t, s in TOKENS]
        final = messages[-1].final
        assert final.deployment_id == "d1"
        assert final.finish_reason == common.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (2, 3)
        timings = final.timings
        assert timings.queue_ms == 0.0  # a free slot at once
        assert timings.ttft_ms == pytest.approx(5.0)
        assert timings.tpot_ms == pytest.approx(20.0)  # two 20 ms gaps between three tokens
        assert timings.total_ms == pytest.approx(45.0)  # the final follows the last token
        sent = worker.received[0]
        assert (list(sent.prompt_token_ids), sent.max_tokens, sent.request_id) == (
            [1, 2],
            3,
            "req-7",
        )
        assert sent.sampling.top_k == 4

    run(redis_url, scenario, clock=clock)


def test_headers_reach_the_client_before_the_first_token(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(before_first=asyncio.Event())
        await h.add_deployment("d1", worker)
        call = h.generate(deployment_id="d1")
        async with asyncio.timeout(WAIT_S):
            await call.initial_metadata()
        await h.until(lambda: worker.received, "the request reached the worker")
        worker.before_first.set()
        messages = await read_rest(call)
        assert messages[-1].final.usage.completion_tokens == 3

    run(redis_url, scenario)


def test_model_id_routes_to_the_ready_deployment_with_the_shortest_queue(redis_url):
    async def scenario(h: Harness):
        busy, idle = FakeWorker(gate=asyncio.Event()), FakeWorker()
        await h.add_deployment("busy", busy)
        await h.add_deployment("idle", idle)
        await h.add_deployment("starting", None, state=deploy_pb.DEPLOYMENT_STATE_STARTING)
        first = h.generate(deployment_id="busy")
        await first.read()
        messages = await h.collect(model_id="m")
        assert messages[-1].final.deployment_id == "idle"
        busy.gate.set()
        assert (await first.read()).delta.text == "lo"

    run(redis_url, scenario)


def test_unknown_targets_are_not_found(redis_url):
    async def scenario(h: Harness):
        error = await h.status_of(deployment_id="nope")
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "deployment nope not found" in error.details()
        error = await h.status_of(model_id="no-model")
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "model no-model has no deployment" in error.details()

    run(redis_url, scenario)


def test_deployments_that_are_not_ready_fail_precondition(redis_url):
    async def scenario(h: Harness):
        await h.add_deployment(
            "d1", None, state=deploy_pb.DEPLOYMENT_STATE_FAILED, reason="worker exited with 1"
        )
        await h.add_deployment("d2", None, state=deploy_pb.DEPLOYMENT_STATE_STARTING)
        error = await h.status_of(deployment_id="d1")
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == "deployment d1 is FAILED: worker exited with 1"
        error = await h.status_of(model_id="m")
        assert error.code() == grpc.StatusCode.UNAVAILABLE  # d2 serves soon: retry
        assert "model m has no READY deployment" in error.details()
        assert "deployment d2 is STARTING" in error.details()

    run(redis_url, scenario)


def test_a_model_s_request_refused_while_its_deployment_restarts_counts_against_it(redis_url):
    """None of m's deployments READY (d2 restarting, d1 FAILED): a request for m is
    refused before routing, and counted as d2's failure and SLO miss (a probe saw 38 of 39
    such refusals filed under no model, status reading 89 % goodput for a real 17 %). A
    model nobody deployed still gets no series; nor does one the caller may not see."""

    async def scenario(h: Harness):
        objectives = common.ServiceObjectives(ttft_slo_ms=500)
        await h.add_deployment(
            "d1", None, state=deploy_pb.DEPLOYMENT_STATE_FAILED, objectives=objectives
        )
        await h.add_deployment(
            "d2", None, state=deploy_pb.DEPLOYMENT_STATE_STARTING, objectives=objectives
        )
        await h.servicer.router.refresh()
        for _ in range(3):
            error = await h.status_of(model_id="m")
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        error = await h.status_of(model_id="nobody-deployed-this")
        assert error.code() == grpc.StatusCode.NOT_FOUND
        (tally,) = h.servicer.metrics.stats()
        assert (tally.deployment_id, tally.model_id) == ("d2", "m")
        assert (tally.completed, tally.failed, tally.slo_missed) == (0, 3, 3)

    run(redis_url, scenario)


def test_a_call_whose_own_deadline_passes_misses_only_an_objective_it_missed(redis_url):
    """A gRPC timeout (the client's, no objective of the request's) ended a stream whose
    first token came within the TTFT SLO: counted an SLO miss (a probe). Now it counts as a
    hang-up does: failed, DEADLINE_EXCEEDED, missed only if an objective was."""

    async def scenario(h: Harness):
        objectives = common.ServiceObjectives(ttft_slo_ms=5_000)
        await h.add_deployment("d1", FakeWorker(hang=True), objectives=objectives)
        request = inference_pb.GenerateRequest(
            request_id="timed", deployment_id="d1", prompt="hello", max_tokens=3
        )
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for _message in h.client.Generate(request, timeout=0.5):
                pass
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await h.until(
            lambda: any(s.failed for s in h.servicer.metrics.stats()), "the request's record"
        )
        (tally,) = h.servicer.metrics.stats()
        assert (tally.failed, tally.slo_missed) == (1, 0)

    run(redis_url, scenario)


def test_a_deployment_that_becomes_ready_is_served_without_waiting_for_a_refresh(redis_url):
    async def scenario(h: Harness):
        record = await h.add_deployment(
            "d1", FakeWorker(), state=deploy_pb.DEPLOYMENT_STATE_STARTING
        )
        assert (await h.status_of(deployment_id="d1")).code() == grpc.StatusCode.UNAVAILABLE
        record.state = READY
        await h.store.put_deployment(record)
        messages = await h.collect(deployment_id="d1")
        assert messages[-1].final.deployment_id == "d1"

    run(redis_url, scenario)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"max_tokens": 17}, "max_tokens 17 exceeds max_output_tokens 16 of deployment d1"),
        ({"sampling": common.SamplingParams(temperature=-1)}, "sampling.temperature"),
        ({"sampling": common.SamplingParams(top_p=1.5)}, "sampling.top_p must be within [0, 1]"),
        ({"deployment_id": None}, "set model_id or deployment_id"),
    ],
)
def test_invalid_requests_are_rejected(redis_url, fields, message):
    async def scenario(h: Harness):
        worker = FakeWorker()
        await h.add_deployment("d1", worker, max_output_tokens=16)
        request = {"deployment_id": "d1", **fields}
        if request["deployment_id"] is None:
            del request["deployment_id"]
        error = await h.status_of(**request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details()
        assert worker.received == []

    run(redis_url, scenario)


def test_an_unset_max_tokens_is_the_deployments_max_output_tokens(redis_url):
    # OpenAI's chat API: no max_tokens means as many as the model allows.
    async def scenario(h: Harness):
        worker = FakeWorker()
        await h.add_deployment("d1", worker, max_output_tokens=16)
        await h.collect(deployment_id="d1", max_tokens=0)
        await h.collect(request_id="r2", deployment_id="d1", max_tokens=5)
        assert [r.max_tokens for r in worker.received] == [16, 5]
        # Only the unset one may be cut to what the worker's sequence leaves.
        assert [r.max_tokens_is_bound for r in worker.received] == [True, False]

    run(redis_url, scenario)


def test_a_max_tokens_default_is_capped_by_the_deployment_not_refused(redis_url):
    # OpenAI's completions default (16) on a deployment allowing 10 output tokens: 10,
    # as for an unset max_tokens; on one allowing 16 or more: 16.
    async def scenario(h: Harness):
        small, large = FakeWorker(), FakeWorker()
        await h.add_deployment("small", small, max_output_tokens=10)
        await h.add_deployment("large", large, max_output_tokens=64)
        await h.collect(deployment_id="small", max_tokens=0, max_tokens_default=16)
        await h.collect(request_id="r2", deployment_id="large", max_tokens=0, max_tokens_default=16)
        assert [(r.max_tokens, r.max_tokens_is_bound) for r in small.received] == [(10, True)]
        assert [(r.max_tokens, r.max_tokens_is_bound) for r in large.received] == [(16, True)]

    run(redis_url, scenario)


def test_full_queue_is_resource_exhausted(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(gate=asyncio.Event())
        await h.add_deployment("d1", worker, batch_size=1)
        running = h.generate(request_id="running", deployment_id="d1")
        await running.read()
        waiting = asyncio.create_task(h.collect(request_id="waiting", deployment_id="d1"))
        await h.until_waiting("d1", 1)
        error = await h.status_of(request_id="rejected", deployment_id="d1")
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == "queue of deployment d1 is full (1 waiting)"
        worker.gate.set()
        assert (await read_rest(running))[-1].request_id == "running"
        assert (await waiting)[-1].final.finish_reason == common.FINISH_REASON_LENGTH
        assert [r.request_id for r in worker.received] == ["running", "waiting"]

    run(redis_url, scenario, queue_capacity=1)


def test_priority_request_is_served_before_earlier_queued_ones(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(gate=asyncio.Event())
        await h.add_deployment("d1", worker, batch_size=1)
        running = h.generate(request_id="running", deployment_id="d1")
        await running.read()
        queued = []
        for name, priority in [("b", False), ("c", False), ("p", True)]:
            queued.append(
                asyncio.create_task(
                    h.collect(request_id=name, deployment_id="d1", priority=priority)
                )
            )
            await h.until_waiting("d1", len(queued))
        worker.gate.set()
        await asyncio.gather(*queued)
        assert [r.request_id for r in worker.received] == ["running", "p", "b", "c"]
        assert (await read_rest(running))[-1].HasField("final")

    run(redis_url, scenario)


def test_client_cancel_reaches_the_worker_and_frees_the_slot(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(hang=True)
        await h.add_deployment("d1", worker, batch_size=1)
        call = h.generate(deployment_id="d1")
        assert (await call.read()).delta.token_ids == [TOKENS[0][0]]
        call.cancel()
        async with asyncio.timeout(WAIT_S):
            await worker.cancelled.wait()
        queue = h.servicer.queues.get("d1")
        await h.until(lambda: queue.running == 0, "slot released")
        worker.hang = False
        messages = await h.collect(request_id="after", deployment_id="d1")
        assert messages[-1].final.usage.completion_tokens == 3

    run(redis_url, scenario)


def test_client_deadline_stops_the_worker_and_frees_the_slot(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(hang=True)
        await h.add_deployment("d1", worker, batch_size=1)
        # Time for the lookup and the worker's session before the first token; the
        # deadline then passes while the worker hangs.
        call = h.client.Generate(
            inference_pb.GenerateRequest(
                request_id="r1", deployment_id="d1", prompt="hi", max_tokens=3
            ),
            timeout=3.0,
        )
        assert (await call.read()).delta.token_ids == [TOKENS[0][0]]
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await read_rest(call)
        assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        async with asyncio.timeout(WAIT_S):
            await worker.cancelled.wait()
        queue = h.servicer.queues.get("d1")
        await h.until(lambda: queue.running == 0, "slot released")
        assert await unreachable_events(h.store) == []

    run(redis_url, scenario)


def test_client_cancel_while_queued_leaves_the_queue(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(gate=asyncio.Event())
        await h.add_deployment("d1", worker, batch_size=1)
        running = h.generate(request_id="running", deployment_id="d1")
        await running.read()
        queued = h.generate(request_id="queued", deployment_id="d1")
        queue = h.servicer.queues.get("d1")
        await h.until_waiting("d1", 1)
        queued.cancel()
        await h.until_waiting("d1", 0)
        worker.gate.set()
        assert (await read_rest(running))[-1].HasField("final")
        assert [r.request_id for r in worker.received] == ["running"]
        assert (queue.running, queue.waiting) == (0, 0)

    run(redis_url, scenario)


async def unreachable_events(store: StateStore) -> list[dict]:
    events = [json.loads(data["json"]) for _, data in await store.redis.xrange(keys.events())]
    return [e for e in events if e["kind"] == "worker_unreachable"]


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[inference_pb.GenerateResponse]:
    """The remaining messages of a call already read with ``read()`` (the two reading
    styles cannot be mixed on one call)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def test_worker_stopped_mid_stream_is_unavailable_and_reported(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(hang=True)
        await h.add_deployment("d1", worker)
        call = h.generate(deployment_id="d1")
        await call.read()
        await h.workers["d1"].stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await read_rest(call)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker of deployment d1 is gone" in failure.value.details()
        events = await unreachable_events(h.store)
        assert [e["deployment_id"] for e in events] == ["d1"]
        assert events[0]["reason"]
        assert h.servicer.queues.get("d1").running == 0

    run(redis_url, scenario)


def test_unreachable_worker_is_unavailable_and_reported(redis_url):
    async def scenario(h: Harness):
        await h.add_deployment("d1", None)
        error = await h.status_of(deployment_id="d1")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker of deployment d1 is gone: UNAVAILABLE" in error.details()
        assert [e["deployment_id"] for e in await unreachable_events(h.store)] == ["d1"]

    run(redis_url, scenario)


def test_stream_ending_without_final_message_is_unavailable(redis_url):
    async def scenario(h: Harness):
        await h.add_deployment("d1", FakeWorker(final=False))
        error = await h.status_of(deployment_id="d1")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "stream ended without a final message" in error.details()
        assert len(await unreachable_events(h.store)) == 1

    run(redis_url, scenario)


def test_invalid_argument_from_the_worker_passes_through(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(
            abort=(grpc.StatusCode.INVALID_ARGUMENT, "prompt has 900 tokens, max 512")
        )
        await h.add_deployment("d1", worker)
        error = await h.status_of(deployment_id="d1")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "prompt has 900 tokens, max 512"
        assert await unreachable_events(h.store) == []

    run(redis_url, scenario)


def test_background_refresh_picks_up_state_changes(redis_url):
    async def scenario(h: Harness):
        record = await h.add_deployment("d1", FakeWorker())
        refresher = asyncio.create_task(h.servicer.refresh_forever(interval_s=0.02))
        try:
            await h.until(lambda: h.servicer.router.deployments(), "cached")
            record.state = deploy_pb.DEPLOYMENT_STATE_FAILED
            record.state_reason = "marked failed"
            await h.store.put_deployment(record)
            await h.until(lambda: h.servicer.router.deployments()[0].state != READY, "refreshed")
            error = await h.status_of(deployment_id="d1")
            assert error.details() == "deployment d1 is FAILED: marked failed"
        finally:
            await cancel_and_wait([refresher])

    run(redis_url, scenario)


def test_requests_share_one_session_per_worker_and_interleave(redis_url):
    async def scenario(h: Harness):
        worker = FakeWorker(gate=asyncio.Event())
        await h.add_deployment("d1", worker, batch_size=2)
        first = h.generate(request_id="first", deployment_id="d1")
        second = h.generate(request_id="second", deployment_id="d1")
        assert (await first.read()).delta.text == "Hel"
        assert (await second.read()).delta.text == "Hel"
        worker.gate.set()
        for call, rid in [(second, "second"), (first, "first")]:
            rest = await read_rest(call)
            assert [m.delta.text for m in rest[:-1]] == ["lo", " world"]
            assert rest[-1].request_id == rid and rest[-1].HasField("final")
        await h.collect(request_id="third", deployment_id="d1")
        assert worker.sessions == 1

    run(redis_url, scenario)


@dataclass
class SessionEndingWorker(FakeWorker):
    """Ends every session (status OK) once ``end`` is set."""

    end: asyncio.Event = field(default_factory=asyncio.Event)

    async def Session(self, request_iterator, context):
        self.sessions += 1
        serving = asyncio.ensure_future(serve_session(request_iterator, context, self.script))
        ending = asyncio.ensure_future(self.end.wait())
        await asyncio.wait([serving, ending], return_when=asyncio.FIRST_COMPLETED)
        serving.cancel()
        ending.cancel()
        self.end.clear()


def test_a_session_the_worker_ends_fails_its_requests_and_the_next_opens_another(redis_url):
    async def scenario(h: Harness):
        worker = SessionEndingWorker(hang=True)
        await h.add_deployment("d1", worker)
        call = h.generate(deployment_id="d1")
        await call.read()
        worker.end.set()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await read_rest(call)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the worker ended the session" in failure.value.details()
        assert h.servicer.queues.get("d1").running == 0
        worker.hang = False
        messages = await h.collect(request_id="after", deployment_id="d1")
        assert messages[-1].final.usage.completion_tokens == 3
        assert worker.sessions == 2

    run(redis_url, scenario)


def test_a_gone_replica_is_retried_elsewhere_and_avoided_until_taken_out(redis_url):
    """Replica 0's worker is unreachable: a request routed there before anything streamed
    runs on replica 1 instead, and the next requests go straight to replica 1."""

    async def scenario(h: Harness):
        live = FakeWorker()
        binding = ServiceBinding(
            live, worker_grpc.add_WorkerServiceServicer_to_server, "iserve.v1.WorkerService"
        )
        server, port, _ = await start_server([binding], "127.0.0.1:0")
        h.workers["d1.r1"] = server
        deployment = await h.add_deployment("d1", None)  # nothing listens at replica 0's
        deployment.replicas.add(index=0, worker_address=deployment.worker_address, state=READY)
        deployment.replicas.add(index=1, worker_address=f"127.0.0.1:{port}", state=READY)
        await h.store.put_deployment(deployment)
        for n in range(3):
            messages = await h.collect(deployment_id="d1", request_id=f"r{n}")
            assert messages[-1].final.finish_reason == common.FINISH_REASON_LENGTH
        # One report for the one request that found replica 0 gone; none after it.
        events = await unreachable_events(h.store)
        assert [e["deployment_id"] for e in events] == ["d1"]
        assert h.servicer.queues.get("d1.r1") is not None

    run(redis_url, scenario)


def test_the_last_replica_gone_is_unavailable_without_a_retry(redis_url):
    async def scenario(h: Harness):
        deployment = await h.add_deployment("d1", None)
        deployment.replicas.add(index=0, worker_address=deployment.worker_address, state=READY)
        await h.store.put_deployment(deployment)
        error = await h.status_of(deployment_id="d1")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert len(await unreachable_events(h.store)) == 1

    run(redis_url, scenario)


def test_a_prompt_with_its_special_tokens_reaches_the_worker_so(redis_url):
    # The gateway's rendered chat template holds its BOS: the worker must add none.
    async def scenario(h: Harness):
        worker = FakeWorker()
        await h.add_deployment("d1", worker, max_output_tokens=16)
        await h.collect(deployment_id="d1", max_tokens=2, prompt_has_special_tokens=True)
        await h.collect(request_id="r2", deployment_id="d1", max_tokens=2)
        assert [r.prompt_has_special_tokens for r in worker.received] == [True, False]

    run(redis_url, scenario)


def test_a_model_request_routed_to_a_just_removed_deployment_runs_on_its_successor(redis_url):
    """The router's cache still holds d1 READY when it is removed and d2 deployed (a
    refresh is up to a second away): the request by model id that finds d1's worker gone
    is served by d2, not failed; one by deployment id is not rerouted."""

    async def scenario(h: Harness):
        removed = await h.add_deployment("d1", None)  # nothing listens: workers stopped
        await h.servicer.router.refresh()  # the cache: d1 READY
        await h.store.delete_deployment(removed)
        successor = FakeWorker()
        await h.add_deployment("d2", successor)
        messages = await h.collect(model_id="m")
        assert messages[-1].final.deployment_id == "d2"
        assert len(successor.received) == 1
        await h.add_deployment("d3", None)
        error = await h.status_of(request_id="r3", deployment_id="d3")
        assert error.code() == grpc.StatusCode.UNAVAILABLE

    run(redis_url, scenario)


def test_a_deployment_request_finds_the_worker_its_deployment_was_restarted_on(redis_url):
    """The router's cache holds d1 READY on a worker that is gone; Redis already names
    the one it was restarted on (a restart or `iserve up` a moment ago): a request by
    deployment id runs there instead of failing."""

    async def scenario(h: Harness):
        await h.add_deployment("d1", None)  # the worker before the restart: gone
        await h.servicer.router.refresh()  # the cache: d1 READY there
        restarted = FakeWorker()
        await h.add_deployment("d1", restarted)  # the same deployment, a new worker
        messages = await h.collect(deployment_id="d1")
        assert messages[-1].final.deployment_id == "d1"
        assert len(restarted.received) == 1

    run(redis_url, scenario)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_request_whose_deployment_was_removed_as_its_worker_went_is_told_so(redis_url, replicas):
    """The router's cache holds d1 READY; its workers are gone and its record deleted (a
    remove while requests waited: one admitted as the drain ended, or sent just after
    `iserve remove` returned): FAILED_PRECONDITION saying so, not NOT_FOUND as for an id
    that never existed (a probe saw 18 of 30), nor the connection's error, nor, with two
    replicas, that a request which never waited was removed while it waited."""

    async def scenario(h: Harness):
        removed = await h.add_deployment("d1", None)  # nothing listens: workers stopped
        if replicas == 2:
            removed.replicas.add(index=0, worker_address=removed.worker_address, state=READY)
            address = f"127.0.0.1:{free_port()}"
            removed.replicas.add(index=1, worker_address=address, state=READY)
            await h.store.put_deployment(removed)
        await h.servicer.router.refresh()  # the cache: d1 READY
        await h.store.delete_deployment(removed)
        error = await h.status_of(request_id="r", deployment_id="d1")
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert error.details() == (
            "deployment d1 was removed; its worker stopped before serving the request"
        )

    run(redis_url, scenario)


def test_a_request_refused_before_routing_counts_against_the_deployment_it_names(redis_url):
    """An empty prompt is refused before the request is routed; it still failed on d1,
    as a max_tokens over the limit (refused at admission) does. An id nobody deployed
    gets no series of its own."""

    async def scenario(h: Harness):
        await h.add_deployment("d1", FakeWorker())
        await h.servicer.router.refresh()
        for fields in ({"prompt": ""}, {"max_tokens": 17}, {"deployment_id": "made-up"}):
            error = await h.status_of(**{"deployment_id": "d1", **fields})
            assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        (tally,) = h.servicer.metrics.stats()
        assert (tally.deployment_id, tally.completed, tally.failed) == ("d1", 0, 2)

    run(redis_url, scenario)


def test_a_stream_closed_between_messages_is_counted_cancelled(redis_url):
    """gRPC closes a handler's generator at a yield when the client goes away between
    messages: that request failed (CANCELLED), it did not succeed with no finish reason."""

    class Context:
        def add_done_callback(self, _callback) -> None:
            pass

        async def send_initial_metadata(self, _metadata) -> None:
            pass

        def time_remaining(self) -> float | None:
            return None  # no deadline

    async def scenario(h: Harness):
        await h.add_deployment("d1", FakeWorker(hang=True))
        request = inference_pb.GenerateRequest(
            request_id="r1", deployment_id="d1", prompt="hello", max_tokens=3
        )
        stream = h.servicer.Generate(request, Context())
        first = await stream.__anext__()
        assert first.HasField("delta")
        await stream.aclose()
        (tally,) = h.servicer.metrics.stats()
        assert (tally.completed, tally.failed) == (0, 1)

    run(redis_url, scenario)


@pytest.mark.parametrize(
    ("budget_s", "remaining_s", "code"),
    [
        (0.3, 0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
        # the client's deadline passed; its hang-up reached the server 2 ms before the
        # server's own deadline, which started when the headers arrived
        (0.3, 0.002, grpc.StatusCode.DEADLINE_EXCEEDED),
        (0.3, 0.2, grpc.StatusCode.CANCELLED),
        (60.0, 0.06, grpc.StatusCode.CANCELLED),  # the tolerance is 50 ms at most
        (0.01, 0.002, grpc.StatusCode.CANCELLED),  # and a tenth of a short call
        (None, None, grpc.StatusCode.CANCELLED),  # no deadline: a hang-up
    ],
)
def test_a_hang_up_at_the_deadline_counts_as_the_deadline(budget_s, remaining_s, code):
    class Context:
        def time_remaining(self):
            return remaining_s

    assert ended_by_client(Context(), budget_s) == code


def test_a_client_deadline_passing_while_queued_counts_as_deadline_exceeded(redis_url):
    """What the client saw, DEADLINE_EXCEEDED, not CANCELLED; a client that hangs up is
    still CANCELLED."""

    async def scenario(h: Harness):
        worker = FakeWorker(gate=asyncio.Event())
        await h.add_deployment("d1", worker, batch_size=1)
        running = h.generate(request_id="running", deployment_id="d1")
        await running.read()
        timed = h.client.Generate(
            inference_pb.GenerateRequest(
                request_id="timed", deployment_id="d1", prompt="hello", max_tokens=3
            ),
            # Long enough that the server takes a hang-up up to 50 ms (DEADLINE_SKEW_S)
            # before its own deadline for the deadline, not a tenth of the budget.
            timeout=1.0,
        )
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await timed.read()
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def failures(code: str) -> float | None:
            labels = {"model_id": "m", "deployment_id": "d1", "code": code}
            return h.servicer.registry.get_sample_value("iserve_request_failure_total", labels)

        # The server learns of the deadline on its own clock: until it has, the expired
        # request still counts as waiting and would pass for the next one.
        await h.until(lambda: failures("DEADLINE_EXCEEDED") == 1, "the expiry to be counted")
        await h.until_waiting("d1", 0)
        hung_up = h.generate(request_id="hung-up", deployment_id="d1")
        await h.until_waiting("d1", 1)
        hung_up.cancel()

        await h.until(lambda: failures("CANCELLED") == 1, "the hang-up to be counted")
        assert failures("DEADLINE_EXCEEDED") == 1
        worker.gate.set()
        await read_rest(running)

    run(redis_url, scenario)


def test_a_request_sent_on_from_a_deployment_gone_to_a_full_queue_says_why(redis_url):
    """A model's request accepted and waiting on d1, which is removed: routed afresh to
    d2, whose queue is full. The client, which saw it accepted, is told why it moved,
    not only that a queue is full."""

    async def scenario(h: Harness):
        workers = {d: FakeWorker(gate=asyncio.Event()) for d in ("d1", "d2")}
        d1 = await h.add_deployment("d1", workers["d1"], batch_size=1)
        await h.add_deployment("d2", workers["d2"], batch_size=1)
        running = {d: h.generate(request_id=f"run-{d}", deployment_id=d) for d in workers}
        for call in running.values():
            await call.read()
        filler = asyncio.create_task(h.collect(request_id="fill-d2", deployment_id="d2"))
        await h.until_waiting("d2", 1)
        moved = asyncio.create_task(h.status_of(request_id="moved", model_id="m"))
        await h.until_waiting("d1", 1)  # d2's queue is full: the model's request waits on d1
        await h.mark_removing(d1)
        error = await moved
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "queue of deployment d2 is full" in error.details()
        assert "tried there after: deployment d1 stopped serving" in error.details()
        for worker in workers.values():
            worker.gate.set()
        for call in running.values():
            await read_rest(call)
        await filler

    run(redis_url, scenario, queue_capacity=1)


async def _strict_edf(h: Harness, worker: FakeWorker) -> None:
    """Deployment a-edf of model m: EDF, whose first token of a 4000-token prompt is
    predicted at 4 s, past its 300 ms TTFT objective (its prefill model says 1 ms a
    token); one request served, so its predictions count."""
    await h.add_deployment(
        "a-edf",
        worker,
        max_output_tokens=4,
        objectives=common.ServiceObjectives(
            scheduling=common.SCHEDULING_POLICY_EDF, ttft_slo_ms=300
        ),
        latency_model=common.LatencyModel(prefill_ms_per_token=1.0),
    )
    await h.collect(request_id="warm", deployment_id="a-edf", max_tokens=1)


def test_a_model_request_one_deployment_refuses_at_admission_goes_to_another(redis_url):
    """Routed by model id, a request the deployment with the shortest wait refuses at
    admission (a first token its EDF queue predicts late; likewise its limits or a full
    queue) is served by another deployment of the model, not refused while that one has
    room. When every deployment refuses, the first one's refusal is the answer."""

    async def scenario(h: Harness):
        strict, lenient = FakeWorker(), FakeWorker()
        await _strict_edf(h, strict)
        refused = await h.status_of(
            request_id="edf-only", deployment_id="a-edf", prompt="x" * 16_000
        )
        assert refused.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await h.add_deployment("b-fcfs", lenient, max_output_tokens=16)
        messages = await h.collect(request_id="r1", model_id="m", prompt="x" * 16_000)
        assert messages[-1].final.deployment_id == "b-fcfs"
        # Over one deployment's max_output_tokens, within the other's.
        messages = await h.collect(request_id="r2", model_id="m", max_tokens=10)
        assert messages[-1].final.deployment_id == "b-fcfs"
        assert [r.request_id for r in lenient.received] == ["r1", "r2"]
        error = await h.status_of(request_id="r3", model_id="m", max_tokens=20)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens 20 exceeds max_output_tokens" in error.details()

    run(redis_url, scenario)


def test_an_unset_max_tokens_is_resolved_again_where_a_request_moves(redis_url):
    """A model's request with no max_tokens waits on d1 (max_output_tokens 16), which is
    removed; routed afresh to d2 (max_output_tokens 4) it gets d2's limit, not a refusal
    of the 16 d1 filled in."""

    async def scenario(h: Harness):
        first, second = FakeWorker(gate=asyncio.Event()), FakeWorker()
        d1 = await h.add_deployment("d1", first, batch_size=1, max_output_tokens=16)
        running = h.generate(request_id="run", deployment_id="d1")
        await running.read()
        moved = asyncio.create_task(h.collect(request_id="moved", model_id="m", max_tokens=0))
        await h.until_waiting("d1", 1)
        await h.add_deployment("d2", second, max_output_tokens=4)
        await h.mark_removing(d1)
        messages = await moved
        assert messages[-1].final.deployment_id == "d2"
        assert [(r.max_tokens, r.max_tokens_is_bound) for r in second.received] == [(4, True)]
        first.gate.set()
        await read_rest(running)

    run(redis_url, scenario)


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ({"deployment_id": "d1"}, ""),
        ({"model_id": "m"}, "model m has no deployment now: "),
        # The deployment's id where a model's goes: told as a deployment's request
        # ("model d1 has no deployment, and no deployment has that id now", a tester).
        ({"model_id": "d1"}, ""),
    ],
    ids=["by-deployment", "by-model", "by-deployment-id-as-model"],
)
def test_a_request_waiting_on_a_deployment_removed_meanwhile_is_told_so(redis_url, target, says):
    """Waiting on d1 when its record is deleted: FAILED_PRECONDITION (the gateway's 503)
    saying it was removed, not NOT_FOUND as for an id that never existed; by model, whose
    only deployment it was, not NOT_FOUND either (a 404 "model m has no deployment",
    which queued requests got as if the model had never been deployed; a tester)."""

    async def scenario(h: Harness):
        worker = FakeWorker(gate=asyncio.Event())
        d1 = await h.add_deployment("d1", worker, batch_size=1)
        running = h.generate(request_id="run", deployment_id="d1")
        await running.read()
        waiting = asyncio.create_task(h.status_of(request_id="waiting", **target))
        await h.until_waiting("d1", 1)
        await h.store.delete_deployment(d1)
        await h.close_left_out()
        error = await waiting
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert error.details() == (
            f"{says}deployment d1 stopped serving: it was removed while the request waited"
        )
        worker.gate.set()
        await read_rest(running)

    run(redis_url, scenario)


@pytest.mark.parametrize("prefill_ms_per_token", [1.0, 10.0])
def test_a_text_prompt_guessed_over_the_limit_gets_the_workers_refusal(
    redis_url, prefill_ms_per_token
):
    """A text prompt's token count is guessed from its characters; the worker refuses one
    over the deployment's limit. A 4000-token guess on a deployment taking 256 prompt
    tokens is predicted as 256 and goes to the worker, which says it is too long,
    instead of getting a predicted-deadline refusal: at 1 ms a token (0.26 s, inside the
    2 s objective), and at 10 ms, where the limit's own prefill (2.56 s) misses it, as
    docs/scheduling.md says (a tester saw a 504 there)."""

    async def scenario(h: Harness):
        worker = FakeWorker()
        await h.add_deployment(
            "d1",
            worker,
            max_output_tokens=4,
            max_input_tokens=256,
            objectives=common.ServiceObjectives(
                scheduling=common.SCHEDULING_POLICY_EDF, ttft_slo_ms=2000
            ),
            latency_model=common.LatencyModel(prefill_ms_per_token=prefill_ms_per_token),
        )
        await h.collect(request_id="warm", deployment_id="d1", max_tokens=1)
        await h.collect(request_id="long", deployment_id="d1", max_tokens=1, prompt="x" * 16_000)
        assert [r.request_id for r in worker.received] == ["warm", "long"]

    run(redis_url, scenario)


def test_a_prompts_wait_for_the_encoding_thread_is_not_learnt_as_prefill(redis_url, monkeypatch):
    """A worker encodes text prompts in turn; one that waited behind a client's huge
    prompts reached its first token seconds after admission. Learnt as prefill, that
    made the deployment's EDF queue refuse ordinary requests afterwards, idle as it was
    (a tester: an 800-token prompt predicted at 2,972 ms, served in 50-160). The worker
    says how long the prompt waited; the predictor learns the rest."""
    seen = observed(monkeypatch, "first_token_s")

    async def scenario(h: Harness):
        await h.add_deployment("d1", FakeWorker(prompt_wait_s=0.4))
        replies = await h.collect(request_id="r1", deployment_id="d1")
        # The client's own TTFT counts the wait: it waited.
        assert replies[-1].final.timings.ttft_ms >= 400

    run(redis_url, scenario)
    assert len(seen) == 1 and 0 <= seen[0] < 0.2, seen


def test_an_edf_deadline_prices_decode_at_no_more_sequences_than_the_batch_runs(redis_url):
    """A request behind one running on a batch-1 deployment decodes alone when its turn
    comes: its last-token deadline less its decode is priced at one sequence, not two
    (a decode step of two sequences that batch 1 never runs refused requests that met
    their deadlines when sent without one)."""

    async def scenario(h: Harness):
        worker = FakeWorker(gate=asyncio.Event())
        await h.add_deployment(
            "d1",
            worker,
            batch_size=1,
            objectives=common.ServiceObjectives(scheduling=common.SCHEDULING_POLICY_EDF),
            latency_model=common.LatencyModel(
                decode_step_ms=10.0, decode_ms_per_extra_sequence=1000.0
            ),
        )
        worker.gate.set()
        await h.collect(request_id="warm", deployment_id="d1", max_tokens=1)
        worker.gate.clear()
        running = h.generate(request_id="running", deployment_id="d1", max_tokens=1)
        await running.read()
        # 2 decode steps: 20 ms at one sequence; 2 s at two.
        behind = asyncio.create_task(
            h.collect(request_id="behind", deployment_id="d1", max_tokens=3, deadline_ms=1000)
        )
        await h.until_waiting("d1", 1)
        worker.gate.set()
        replies = await behind
        assert replies[-1].HasField("final")
        assert [r.request_id for r in worker.received] == ["warm", "running", "behind"]

    run(redis_url, scenario)


def test_the_queue_time_of_a_request_moved_on_counts_its_wait_where_it_was_first(redis_url):
    """A model's request waits 2 s on d1, which is removed, then 0.5 s on d2: its
    queue_ms is 2.5 s, not the 0.5 s since it joined d2's queue."""
    clock = ManualClock()

    async def scenario(h: Harness):
        first, second = FakeWorker(gate=asyncio.Event()), FakeWorker(gate=asyncio.Event())
        d1 = await h.add_deployment("d1", first, batch_size=1)
        await h.add_deployment("d2", second, batch_size=1)
        running = [h.generate(request_id=f"run{i}", deployment_id=f"d{i}") for i in (1, 2)]
        for call in running:
            await call.read()
        moved = asyncio.create_task(h.collect(request_id="moved", model_id="m"))
        await h.until_waiting("d1", 1)
        clock.advance(2.0)
        await h.mark_removing(d1)
        await h.until_waiting("d2", 1)
        clock.advance(0.5)
        second.gate.set()
        messages = await moved
        assert messages[-1].final.deployment_id == "d2"
        assert messages[-1].final.timings.queue_ms == pytest.approx(2500.0)
        first.gate.set()
        for call in running:
            await read_rest(call)

    run(redis_url, scenario, clock=clock)


def test_a_request_taken_by_a_replica_back_in_service_streams_from_it(redis_url):
    """A request routed afresh once (its replica was taken out while it waited) then
    taken by the other replica back from a restart failed with UNAVAILABLE "replica 0
    ... stopped serving": it checked the replica against its own record, read while
    replica 0 was out. The scheduler's newest record says it serves."""

    async def scenario(h: Harness):
        gated = [FakeWorker(gate=asyncio.Event()) for _ in range(2)]
        servers = []
        for worker in gated:
            binding = ServiceBinding(
                worker, worker_grpc.add_WorkerServiceServicer_to_server, "iserve.v1.WorkerService"
            )
            server, port, _ = await start_server([binding], "127.0.0.1:0")
            servers.append((server, f"127.0.0.1:{port}"))
            h.workers[f"gated{port}"] = server
        d1 = await h.add_deployment("d1", None, batch_size=1)
        for index, (_, address) in enumerate(servers):
            d1.replicas.add(index=index, worker_address=address, state=READY)
        d1.worker_address = servers[0][1]
        await h.store.put_deployment(d1)
        await h.servicer.router.refresh()
        holding = []
        for i in range(2):  # replica 0's one slot, then replica 1's
            holding.append(h.generate(request_id=f"hold{i}", deployment_id="d1"))
            await holding[-1].read()
        waiting = h.generate(request_id="moved", deployment_id="d1")
        await h.until_waiting("d1", 1)  # on replica 0: equal waits, the lower index

        d1.replicas[0].state = deploy_pb.DEPLOYMENT_STATE_STARTING  # taken out
        await h.store.put_deployment(d1)
        await h.close_left_out()  # its queue closes: the request goes to replica 1
        await h.until_waiting("d1.r1", 1)
        gated[0].gate.set()  # what ran on replica 0 ends (its worker died)
        await read_rest(holding[0])

        fresh = FakeWorker()
        binding = ServiceBinding(
            fresh, worker_grpc.add_WorkerServiceServicer_to_server, "iserve.v1.WorkerService"
        )
        server, port, _ = await start_server([binding], "127.0.0.1:0")
        h.workers["fresh"] = server
        d1.replicas[0].state = READY  # back, on another worker
        d1.replicas[0].worker_address = f"127.0.0.1:{port}"
        await h.store.put_deployment(d1)
        await h.servicer.router.refresh()
        await h.servicer._forget_removed(h.servicer.router.deployments())

        messages = [m async for m in waiting]
        assert messages[-1].final.finish_reason == common.FINISH_REASON_LENGTH
        assert [r.request_id for r in fresh.received] == ["moved"]
        gated[1].gate.set()
        await read_rest(holding[1])

    run(redis_url, scenario)


def test_a_request_id_is_logged_escaped_so_a_client_writes_no_line_of_its_own(redis_url, caplog):
    """The id is logged before it is checked: one holding a newline wrote a forged line
    into the scheduler's log, and a NUL made the log a binary file to grep."""
    forged = "x\n2026-11-27 09:00:00,000 INFO scheduler iserve.scheduler: request FORGED\0"

    async def scenario(h: Harness):
        await h.add_deployment("d1", FakeWorker())
        error = await h.status_of(deployment_id="d1", request_id=forged)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        long_id = await h.status_of(deployment_id="d1", request_id="\t" * 500)
        assert long_id.code() == grpc.StatusCode.INVALID_ARGUMENT

    with caplog.at_level(logging.INFO, logger="iserve.grpc"):
        run(redis_url, scenario)
    logged = [r.getMessage() for r in caplog.records if "request_id=" in r.getMessage()]
    assert len(logged) == 2, logged
    for message in logged:
        head = message.split(" -> ")[0]  # the id as logged, before the status's message
        assert "\n" not in head and "\0" not in head and "\t" not in head, message
    assert "request_id='x\\n2026-11-27 09:00:00" in logged[0]
    assert len(logged[1].split(" -> ")[0]) < 700 and "..." in logged[1]


def test_a_model_request_edf_finds_hopeless_is_not_served_late_by_an_fcfs_deployment(redis_url):
    """Routed by model with a deadline of its own, a request the EDF deployment refuses
    (its decode alone takes longer than the deadline) went on to an FCFS deployment of
    the model, which served it seconds late with success. By model, an FCFS deployment
    checks a request's own deadline at admission too; by deployment id it serves what
    it takes, however late. A request without a deadline is served as before."""

    async def scenario(h: Harness):
        strict, lenient = FakeWorker(), FakeWorker()
        slow = common.LatencyModel(decode_step_ms=100.0)
        await h.add_deployment(
            "a-edf",
            strict,
            objectives=common.ServiceObjectives(scheduling=common.SCHEDULING_POLICY_EDF),
            latency_model=slow,
        )
        await h.add_deployment("b-fcfs", lenient, latency_model=slow)
        for name in ("a-edf", "b-fcfs"):  # measured: the queues predict from here on
            await h.collect(request_id=f"warm-{name}", deployment_id=name, max_tokens=1)
        # 9 decode steps of 100 ms: 0.9 s, past the 300 ms deadline on either.
        hopeless = dict(model_id="m", max_tokens=10, deadline_ms=300)
        error = await h.status_of(request_id="hopeless", **hopeless)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert (
            "the decode of max_tokens (10) alone takes longer than the deadline" in error.details()
        )
        assert [r.request_id for r in lenient.received] == ["warm-b-fcfs"]
        # By deployment id, FCFS serves it (late); so it does by that id where a model's
        # goes (the gateway's "model", which was refused late as a model's request, a
        # tester); by model without a deadline, too.
        await h.collect(request_id="direct", deployment_id="b-fcfs", max_tokens=10, deadline_ms=300)
        await h.collect(request_id="pinned", model_id="b-fcfs", max_tokens=10, deadline_ms=300)
        messages = await h.collect(request_id="no-deadline", model_id="m", max_tokens=10)
        assert messages[-1].HasField("final")
        assert {"direct", "pinned", "no-deadline"} <= {
            r.request_id for r in lenient.received + strict.received
        }

    run(redis_url, scenario)


def test_a_model_request_without_a_deadline_refused_everywhere_is_told_the_queue_is_full(
    redis_url,
):
    """An overloaded model whose EDF deployment predicts its TTFT objective missed and
    whose FCFS deployment's queue is full answered 504 (the EDF one ranked first), which
    a client cannot tell from a timeout: a request with no deadline of its own now gets
    the full queue's RESOURCE_EXHAUSTED (429, retry later); one with a deadline of its
    own keeps the first refusal."""
    from scheduler_svc.routing import answered_refusal
    from services import errors

    a, b = deploy_pb.Deployment(deployment_id="a"), deploy_pb.Deployment(deployment_id="b")
    late, full = errors.DeadlineExceeded("late"), errors.ResourceExhausted("full")
    assert answered_refusal([(a, late), (b, full)], own_deadline=False) == (b, full)
    assert answered_refusal([(a, late), (b, full)], own_deadline=True) == (a, late)
    too_long = errors.InvalidArgument("too long")
    assert answered_refusal([(a, too_long), (b, late)], own_deadline=False) == (a, too_long)

    async def scenario(h: Harness):
        busy = FakeWorker(gate=asyncio.Event())
        await _strict_edf(h, FakeWorker())
        await h.add_deployment("b-fcfs", busy, batch_size=1)
        running = h.generate(request_id="running", deployment_id="b-fcfs")
        await running.read()
        waiting = asyncio.create_task(h.collect(request_id="waiting", deployment_id="b-fcfs"))
        await h.until_waiting("b-fcfs", 1)
        # 4000 tokens of prefill: 4 s on a-edf, past its 300 ms; b-fcfs is full.
        error = await h.status_of(request_id="over", model_id="m", prompt="x" * 16_000)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        busy.gate.set()
        await read_rest(running)
        await waiting

    run(redis_url, scenario, queue_capacity=1)


def observed(monkeypatch, name: str) -> list[float]:
    """The ``name`` argument of every LatencyPredictor.observe call from now on."""
    from scheduler_svc.predictor import LatencyPredictor

    seen: list[float] = []
    observe = LatencyPredictor.observe

    def recording(self, **kwargs):
        seen.append(kwargs[name])
        observe(self, **kwargs)

    monkeypatch.setattr(LatencyPredictor, "observe", recording)
    return seen


def test_a_wave_decoding_together_is_learned_at_the_batch_it_ran(redis_url, monkeypatch):
    """The decode line learned each request's TPOT against the mean of the sequences
    running at its admission and at its end: four requests admitted and decoding
    together read as about 2.5, and the per-sequence cost came out too high or too low
    after bursts. Each now counts the sequences running over its own decode, time
    weighted: 4 for each of a wave of 4."""
    seen = observed(monkeypatch, "running")

    async def scenario(h: Harness):
        worker = FakeWorker(tokens=[(i, "x") for i in range(8)], token_delay_s=0.05)
        await h.add_deployment("d1", worker, batch_size=4)
        await asyncio.gather(
            *(h.collect(request_id=f"r{i}", deployment_id="d1", max_tokens=8) for i in range(4))
        )

    run(redis_url, scenario)
    assert len(seen) == 4 and all(3.5 <= r <= 4.001 for r in seen), seen


def test_a_request_sent_without_an_id_gets_one_in_its_responses_and_log(redis_url, caplog):
    """Its log lines read "request - served …": no two could be told apart (a probe)."""

    async def scenario(h: Harness):
        await h.add_deployment("d1", FakeWorker())
        first = await h.collect(deployment_id="d1", request_id="")
        second = await h.collect(deployment_id="d1", request_id="")
        ids = [{m.request_id for m in messages} for messages in (first, second)]
        assert all(len(given) == 1 for given in ids), ids
        [one], [two] = ids
        assert one != two and one.startswith("srv-") and two.startswith("srv-")
        return one

    given = []

    async def kept(h: Harness):
        given.append(await scenario(h))

    with caplog.at_level(logging.INFO, logger="iserve.scheduler"):
        run(redis_url, kept)
    assert any(f"request {given[0]} served by " in r.getMessage() for r in caplog.records)


def test_a_deployment_that_measured_nothing_does_not_serve_what_another_found_hopeless(
    redis_url,
):
    """By model, a request whose deadline a measured deployment finds unreachable (its
    own decode alone passes it) went on to a deployment of the model that had measured
    nothing yet, and so predicted nothing, and was served late with success (a tester:
    64 tokens due in 1 ms, served in 441 ms). The deployment that finds it so is tried
    first, and one that cannot judge repeats its refusal; with none that can judge it, a
    deadline request is served (that is how they learn), and a reachable one goes where
    the wait is shortest, a new deployment too (sorted last, one took none: a tester)."""

    async def scenario(h: Harness):
        judged, cold, alone = FakeWorker(), FakeWorker(), FakeWorker()
        await h.add_deployment("n-cold", alone, model_id="n")
        served = await h.collect(request_id="learns", model_id="n", max_tokens=3, deadline_ms=1)
        assert served[-1].final.deployment_id == "n-cold"
        # Named to rank first among equals: the cold one would be tried before the other.
        await h.add_deployment("a-cold", cold)
        await h.add_deployment(
            "b-edf",
            judged,
            objectives=common.ServiceObjectives(scheduling=common.SCHEDULING_POLICY_EDF),
            latency_model=common.LatencyModel(decode_step_ms=100.0),
        )
        await h.collect(request_id="warm", deployment_id="b-edf", max_tokens=1)
        await h.servicer.router.refresh()  # both ranked for the model
        ranked = await h.servicer.router.ranked_for_model("m")
        assert [d.deployment_id for d in ranked] == ["a-cold", "b-edf"]
        # 9 decode steps of 100 ms on b-edf: 0.9 s, past the 300 ms deadline.
        error = await h.status_of(
            request_id="hopeless", model_id="m", max_tokens=10, deadline_ms=300
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "alone takes longer than the deadline" in error.details()
        assert cold.received == []
        # Reachable (1 decode step of 100 ms): where the wait is shortest, the cold one.
        easy = await h.collect(request_id="easy", model_id="m", max_tokens=2, deadline_ms=60_000)
        assert easy[-1].final.deployment_id == "a-cold"
        # Without a deadline of its own it goes where it would have.
        messages = await h.collect(request_id="no-deadline", model_id="m", max_tokens=10)
        assert messages[-1].HasField("final")

    run(redis_url, scenario)


def test_a_replica_that_measured_nothing_does_not_serve_what_its_sibling_found_hopeless(
    redis_url,
):
    """Replica 1 had measured nothing and served, late and with success, a request
    replica 0 had just found hopeless (a tester): the replica that knows most judges."""

    async def scenario(h: Harness):
        first, second = FakeWorker(), FakeWorker()
        binding = ServiceBinding(
            second, worker_grpc.add_WorkerServiceServicer_to_server, "iserve.v1.WorkerService"
        )
        server, port, _ = await start_server([binding], "127.0.0.1:0")
        h.workers["pair.r1"] = server
        pair = await h.add_deployment(
            "pair",
            first,
            objectives=common.ServiceObjectives(scheduling=common.SCHEDULING_POLICY_EDF),
        )
        pair.replicas.add(index=0, worker_address=pair.worker_address, state=READY)
        pair.replicas.add(index=1, worker_address=f"127.0.0.1:{port}", state=READY)
        await h.store.put_deployment(pair)
        queue = h.servicer.queues.queue_for(pair, 0)  # replica 0 measured a slow decode
        queue.predictor.observe(
            prompt_tokens=4, prompt_chars=16, first_token_s=0.01, tpot_s=0.1, running=1
        )
        for n in range(3):
            error = await h.status_of(
                request_id=f"hopeless-{n}", deployment_id="pair", max_tokens=10, deadline_ms=300
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert first.received == [] and second.received == []

    run(redis_url, scenario)
