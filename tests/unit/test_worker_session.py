"""``WorkerService.Session`` of the real worker process, through the scheduler's client
(``scheduler_svc.worker_client``): many generations on one stream, errors and cancels
per generation, and every generation failing when the worker dies."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from monitor_agent.worker.session import serve_session
from scheduler_svc.worker_client import WorkerClients, WorkerStream, WorkerStreamError
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from tests.unit.test_worker_process import (
    CANCEL_WAIT_S,
    PROMPT,
    SLOW_TOKENS,
    create_slow_checkpoint,
    start_slow_worker,
    start_worker,
)

GREEDY = common.SamplingParams(ignore_eos=True)
WAIT_S = 30.0


@pytest.fixture(scope="module")
def worker(checkpoint, tmp_path_factory):
    """A worker with two KV-cache slots; yields its address."""
    run_dir = tmp_path_factory.mktemp("session_worker")
    proc, record = start_worker(
        checkpoint, run_dir / "ready.json", run_dir / "worker.log", "--max-batch", "2"
    )
    yield f"127.0.0.1:{record['port']}"
    proc.terminate()
    assert proc.wait(15) == 0, (run_dir / "worker.log").read_text()


@pytest.fixture(scope="module")
def slow_checkpoint(tmp_path_factory) -> Path:
    """A model whose SLOW_TOKENS take seconds: for generations cut short."""
    return create_slow_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def slow_worker(slow_checkpoint, tmp_path_factory):
    """A worker of the slow model with two KV-cache slots; yields its address."""
    run_dir = tmp_path_factory.mktemp("slow_session_worker")
    proc, record = start_slow_worker(slow_checkpoint, run_dir, "--max-batch", "2")
    yield f"127.0.0.1:{record['port']}"
    proc.terminate()
    assert proc.wait(15) == 0, (run_dir / "worker.log").read_text()


def request(
    max_tokens: int, prompt: str = PROMPT, **fields
) -> worker_pb.WorkerServiceGenerateRequest:
    return worker_pb.WorkerServiceGenerateRequest(
        request_id=f"r{max_tokens}", prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, **fields
    )


async def read_all(stream: WorkerStream) -> list[worker_pb.WorkerServiceGenerateResponse]:
    responses = []
    try:
        async with asyncio.timeout(WAIT_S):
            while not responses or not responses[-1].finish_reason:
                responses.append(await stream.read())
    finally:
        stream.close()
    return responses


def stats(address: str) -> worker_pb.GetWorkerStatsResponse:
    with grpc.insecure_channel(address) as channel:
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        return stub.GetWorkerStats(worker_pb.GetWorkerStatsRequest(), timeout=10)


def generate_directly(address: str, message: worker_pb.WorkerServiceGenerateRequest) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        return [r.token_ids[0] for r in stub.Generate(message, timeout=60)]


def test_concurrent_generations_share_one_session_and_match_generate(worker):
    lengths = [12, 20, 7]  # three streams on two slots: one waits on the worker
    expected = [generate_directly(worker, request(n)) for n in lengths]

    async def scenario():
        clients = WorkerClients()
        try:
            session = clients.session(worker)
            streams = [session.start(request(n)) for n in lengths]
            results = await asyncio.gather(*(read_all(s) for s in streams))
            assert clients.session(worker) is session
            return results
        finally:
            await clients.close()

    results = asyncio.run(scenario())
    for responses, want in zip(results, expected, strict=True):
        assert [r.token_ids[0] for r in responses] == want
        assert {r.request_id for r in responses} == {f"r{len(want)}"}
        final = responses[-1]
        assert final.finish_reason == common.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == len(want)
        assert 0 < final.timings.ttft_ms <= final.timings.total_ms
    # The third waited inside the worker for a slot, and says so.
    assert results[2][-1].timings.queue_ms > results[0][-1].timings.queue_ms


def test_a_bad_request_fails_alone_with_its_status(worker):
    async def scenario():
        clients = WorkerClients()
        try:
            session = clients.session(worker)
            good = session.start(request(5))
            bad = session.start(request(5, prompt="", prompt_token_ids=[10**6]))
            with pytest.raises(WorkerStreamError) as failure:
                await read_all(bad)
            assert len(await read_all(good)) == 5
            assert session.is_open
            return failure.value
        finally:
            await clients.close()

    error = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids outside" in error.details


def test_closing_a_stream_cancels_its_generation_on_the_worker(slow_worker):
    worker = slow_worker
    before = stats(worker)

    async def scenario():
        clients = WorkerClients()
        try:
            session = clients.session(worker)
            stream = session.start(request(SLOW_TOKENS))
            for _ in range(3):
                await stream.read()
            stream.close()
            deadline = time.monotonic() + CANCEL_WAIT_S
            while (await asyncio.to_thread(stats, worker)).active_requests:
                assert time.monotonic() < deadline, "the worker kept generating"
                await asyncio.sleep(0.02)
            # The session goes on serving.
            assert len(await read_all(session.start(request(4)))) == 4
        finally:
            await clients.close()

    asyncio.run(scenario())
    after = stats(worker)
    assert after.requests_served == before.requests_served + 2
    assert after.tokens_generated - before.tokens_generated < SLOW_TOKENS


def test_closing_the_session_cancels_every_generation(slow_worker):
    worker = slow_worker
    before = stats(worker)

    async def scenario():
        clients = WorkerClients()
        session = clients.session(worker)
        streams = [session.start(request(SLOW_TOKENS)), session.start(request(SLOW_TOKENS))]
        for stream in streams:
            await stream.read()
        await clients.close()
        for stream in streams:
            with pytest.raises(WorkerStreamError) as failure:
                await read_all(stream)
            assert failure.value.code == grpc.StatusCode.CANCELLED

    asyncio.run(scenario())
    deadline = time.monotonic() + CANCEL_WAIT_S
    while stats(worker).active_requests:
        assert time.monotonic() < deadline, "the worker kept generating"
        time.sleep(0.02)
    # The two run side by side, one slot each, so had either run to its end the two
    # together would have made some 2 * SLOW_TOKENS.
    assert stats(worker).tokens_generated - before.tokens_generated < SLOW_TOKENS


def test_retain_keeps_a_session_until_its_generations_end(worker):
    # A removed deployment's worker drains its generations: the scheduler must not cut them.
    async def scenario():
        clients = WorkerClients()
        try:
            session = clients.session(worker)
            stream = session.start(request(40))
            first = await stream.read()
            await clients.retain(())
            assert session.is_open
            rest = await read_all(stream)
            await clients.retain(())
            assert not session.is_open  # closed once idle
            return [first, *rest]
        finally:
            await clients.close()

    responses = asyncio.run(scenario())
    assert len(responses) == 40 and responses[-1].finish_reason == common.FINISH_REASON_LENGTH


def test_every_stream_fails_unavailable_when_the_worker_dies(slow_checkpoint, tmp_path):
    # The slow model: neither generation may have ended by the time the worker is killed.
    proc, record = start_slow_worker(slow_checkpoint, tmp_path)
    address = f"127.0.0.1:{record['port']}"

    async def scenario():
        clients = WorkerClients()
        try:
            session = clients.session(address)
            streams = [session.start(request(SLOW_TOKENS)), session.start(request(SLOW_TOKENS))]
            await streams[0].read()
            proc.send_signal(signal.SIGKILL)
            for stream in streams:
                with pytest.raises(WorkerStreamError) as failure:
                    await read_all(stream)
                assert failure.value.code == grpc.StatusCode.UNAVAILABLE
            assert not session.is_open
            # A request after the death fails the same way, on a new session.
            later = clients.session(address)
            assert later is not session
            with pytest.raises(WorkerStreamError) as failure:
                await read_all(later.start(request(3)))
            assert failure.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            await clients.close()

    try:
        asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait(15)


class RecordingContext:
    """Stands in for the session's ServicerContext: records what is written."""

    def __init__(self) -> None:
        self.written: list[worker_pb.WorkerServiceSessionResponse] = []

    async def write(self, message: worker_pb.WorkerServiceSessionResponse) -> None:
        self.written.append(message)


def test_a_cancel_right_behind_its_request_ends_the_generation_before_it_runs():
    started: list[str] = []

    async def generate(request):
        started.append(request.request_id)
        yield worker_pb.WorkerServiceGenerateResponse(token_ids=[1], finish_reason=1)

    async def messages():
        # No await between the two: the cancel arrives before the generation's task runs.
        yield worker_pb.WorkerServiceSessionRequest(stream_id=1, generate=request(3))
        yield worker_pb.WorkerServiceSessionRequest(
            stream_id=1, cancel=worker_pb.WorkerServiceSessionCancel()
        )
        yield worker_pb.WorkerServiceSessionRequest(stream_id=2, generate=request(4))

    context = RecordingContext()
    asyncio.run(asyncio.wait_for(serve_session(messages(), context, generate), WAIT_S))
    assert started == ["r4"]
    assert [m.stream_id for m in context.written] == [2]


def test_a_session_whose_status_grpc_lost_ended_as_the_worker_ending_it():
    """gRPC's client reads INTERNAL "Internal error from Core" in place of the status
    when the worker ends the session while a request is being written (a draining
    worker): the session ended, UNAVAILABLE as at EOF. A request sent to a removed
    deployment's worker failed INTERNAL, where it is told of the removal (seen once in
    the fresh-clone CI). A worker's own INTERNAL stays INTERNAL."""
    from scheduler_svc.worker_client import CORE_LOST_STATUS, WorkerSession

    class Call:
        def __init__(self, details: str) -> None:
            self.details = details

        async def read(self):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), self.details
            )

        def cancel(self) -> None:
            pass

    class Stub:
        def __init__(self, details: str) -> None:
            self.details = details

        def Session(self):
            return Call(self.details)

    async def ended(details: str) -> WorkerStreamError:
        session = WorkerSession(Stub(details))
        await asyncio.wait_for(asyncio.shield(session._reader), WAIT_S)
        return session.ended

    lost = asyncio.run(ended(CORE_LOST_STATUS))
    assert lost.code == grpc.StatusCode.UNAVAILABLE
    assert lost.details == f"the worker ended the session ({CORE_LOST_STATUS})"
    own = asyncio.run(ended("the engine failed"))
    assert (own.code, own.details) == (grpc.StatusCode.INTERNAL, "the engine failed")
