"""A worker encodes text prompts off its event loop, in turn: the loop goes on streaming
the other sequences meanwhile (a half-megabyte prompt, refused once encoded, froze every
stream of the worker for a second); a short prompt does not wait behind a long one; a
request cancelled while its prompt waits is not encoded."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from monitor_agent.worker.servicer import SHORT_PROMPT_CHARS, WorkerIdentity, WorkerServicer
from services.api import worker_service_pb2 as worker_pb
from services.errors import ContextLengthExceeded
from services.models.special_tokens import PromptTooLong


class _Engine:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.encoded: list[str] = []
        self.log: list[str] = []

    max_seq_len = 64

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int = 0) -> list[int]:
        self.log.append(f"encoding {text[:8]}")
        if text.startswith("refuse"):
            raise PromptTooLong(
                "too long", limit=max_tokens, chars=len(text), chars_read=100, counted=70
            )
        self.release.wait(timeout=5)
        self.encoded.append(text)
        self.log.append(f"encoded {text}")
        return [1, 2, 3]


class _Runner:
    def __init__(self) -> None:
        self.engine = _Engine()

    def parse(self, prompt_ids, max_tokens, sampling, bound):
        return SimpleNamespace(prompt_ids=prompt_ids)

    async def generate(self, generation, stop, clock):
        return
        yield  # an async generator that steps nothing


def _servicer() -> WorkerServicer:
    return WorkerServicer(_Runner(), WorkerIdentity("d", 0), peak_memory_bytes=lambda: 0)


async def _drain(servicer, request, stop=None) -> None:
    async for _ in servicer._generate(request, stop):
        pass


async def _encoding(servicer, prompt: str, stop=None) -> asyncio.Task:
    """A generation of a text prompt started, once the engine is encoding some prompt."""
    request = worker_pb.WorkerServiceGenerateRequest(prompt=prompt)
    task = asyncio.create_task(_drain(servicer, request, stop))
    while not servicer.runner.engine.log:
        await asyncio.sleep(0.001)
    return task


def test_the_event_loop_runs_while_a_prompt_is_encoded():
    servicer = _servicer()
    engine = servicer.runner.engine

    async def main() -> None:
        task = await _encoding(servicer, "a")
        engine.log.append("the loop ran")
        engine.release.set()
        await task

    asyncio.run(main())
    assert engine.log == ["encoding a", "the loop ran", "encoded a"]


def test_a_request_cancelled_while_its_prompt_waits_is_not_encoded():
    servicer = _servicer()
    engine = servicer.runner.engine

    async def main() -> None:
        first = await _encoding(servicer, "a")
        stop = threading.Event()
        second = asyncio.create_task(
            _drain(servicer, worker_pb.WorkerServiceGenerateRequest(prompt="b"), stop)
        )
        await asyncio.sleep(0.01)  # "b" is queued behind "a"
        stop.set()
        engine.release.set()
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert engine.encoded == ["a"]


def test_a_short_prompt_is_encoded_while_a_long_one_is():
    """One client's long prompts (each read until it can be refused) are encoded in a
    thread of their own: a short prompt sent meanwhile is encoded at once, and says it
    waited for none (a tester: short prompts' first tokens 16 ms -> 1.1-3.9 s behind
    two to six senders of half-megabyte prompts)."""
    servicer = _servicer()
    engine = servicer.runner.engine
    waits: list[float] = []
    servicer.runner.generate = _recording_waits(waits)

    async def main() -> None:
        long = await _encoding(servicer, "L" * (SHORT_PROMPT_CHARS + 1))
        short = asyncio.create_task(
            _drain(servicer, worker_pb.WorkerServiceGenerateRequest(prompt="s"))
        )
        async with asyncio.timeout(5):
            while "encoding s" not in engine.log:
                await asyncio.sleep(0.001)
        engine.log.append("the long one still encoding")
        engine.release.set()
        await asyncio.gather(long, short)

    asyncio.run(main())
    assert engine.log.index("encoding s") < engine.log.index("the long one still encoding")
    assert len(waits) == 2 and min(waits) < 0.05


def test_a_prompt_says_how_long_it_waited_for_the_encoding_thread():
    """Behind another prompt in the encoding thread, a prompt's wait goes in its clock
    (the first message carries it; the scheduler's prefill model leaves it out)."""
    servicer = _servicer()
    engine = servicer.runner.engine
    waits: list[float] = []
    servicer.runner.generate = _recording_waits(waits)

    async def main() -> None:
        first = await _encoding(servicer, "a")
        second = asyncio.create_task(
            _drain(servicer, worker_pb.WorkerServiceGenerateRequest(prompt="b"))
        )
        await asyncio.sleep(0.2)
        engine.release.set()
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert sorted(waits)[0] < 0.05 and sorted(waits)[1] >= 0.15, waits


def test_a_prompt_refused_on_a_prefix_says_what_was_read_and_the_deployments_limit():
    servicer = _servicer()
    request = worker_pb.WorkerServiceGenerateRequest(
        prompt="refuse" * 10, max_prompt_tokens=50, max_prompt_tokens_rule="x" * 100_000
    )
    with pytest.raises(ContextLengthExceeded) as refused:
        asyncio.run(_drain(servicer, request))
    message = str(refused.value)
    assert message.startswith("prompt has more than 50 tokens (its first 100 of 60 characters")
    assert "deployment d accepts at most 50 (" in message
    assert len(message) < 500  # the caller's rule is not echoed whole


def _recording_waits(waits: list[float]):
    async def generate(generation, stop, clock):
        waits.append(clock.prompt_wait_s)
        return
        yield

    return generate


def test_token_id_prompts_are_taken_on_the_loop_as_they_are():
    servicer = _servicer()
    request = worker_pb.WorkerServiceGenerateRequest(prompt_token_ids=[4, 5])
    asyncio.run(_drain(servicer, request))
    assert servicer.runner.engine.log == []


def test_a_top_p_that_is_no_probability_is_refused_not_read_as_unset():
    """0 is proto3's unset (all tokens); NaN, -1 and -inf were read as unset too, where
    the scheduler refuses them (a fuzzing tester)."""
    import math

    import pytest

    from monitor_agent.worker.servicer import sampling_config
    from services.api import common_pb2 as common
    from services.errors import InvalidArgument

    assert sampling_config(common.SamplingParams(top_p=0)).top_p == 1.0
    assert sampling_config(common.SamplingParams(top_p=0.5)).top_p == 0.5
    for bad in (math.nan, -1.0, -math.inf, math.inf):
        with pytest.raises(InvalidArgument, match="top_p"):
            sampling_config(common.SamplingParams(top_p=bad))
