"""A worker encodes text prompts off its event loop, one at a time: the loop goes on
streaming the other sequences meanwhile (a half-megabyte prompt, refused once encoded,
froze every stream of the worker for a second), and a request cancelled while its prompt
waits is not encoded."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from monitor_agent.worker.servicer import WorkerIdentity, WorkerServicer
from services.api import worker_service_pb2 as worker_pb


class _Engine:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.encoded: list[str] = []
        self.log: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.log.append(f"encoding {text}")
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
