"""EngineRunner in process: one engine thread batching requests from the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from monitor_agent.engine.engine import Engine, SamplingConfig
from monitor_agent.worker.runner import BusyLog, EngineRunner, RequestClock
from services.models.checkpoint import create_checkpoint

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
GREEDY = SamplingConfig(ignore_eos=True)
PROMPTS = ["The river runs past the old mill", "A quick brown fox", "Once upon a time", "Hi"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return create_checkpoint(tmp_path_factory.mktemp("runner") / "ckpt", **SMALL, seed=2)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return Engine(checkpoint, max_seq_len=128, max_batch=2, num_threads=1)


@pytest.fixture
def runner(engine: Engine):
    runner = EngineRunner(engine)
    yield runner
    runner.close()
    runner._thread.join(timeout=10)
    assert engine.batch.free_slots == engine.max_batch


async def collect(runner, prompt_ids, max_tokens, clock=None, stop=None) -> list[int]:
    stream = runner.generate(
        runner.parse(prompt_ids, max_tokens, GREEDY),
        stop or threading.Event(),
        clock or RequestClock(),
    )
    return [step.token_id async for step in stream]


def alone(engine: Engine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return [s.token_id for s in engine.generate(prompt_ids, max_tokens, GREEDY)]


def test_concurrent_requests_share_the_slots_first_in_first_out(engine, runner) -> None:
    prompts = [engine.encode(p) for p in PROMPTS]
    lengths = [9, 6, 7, 5]
    expected = [alone(engine, p, n) for p, n in zip(prompts, lengths, strict=True)]
    clocks = [RequestClock() for _ in prompts]

    async def scenario():
        return await asyncio.gather(
            *(collect(runner, p, n, c) for p, n, c in zip(prompts, lengths, clocks, strict=True))
        )

    assert asyncio.run(scenario()) == expected
    # Two slots: the first two start at once; the third takes the slot the second frees
    # (6 tokens) and the fourth the one the first frees (9 tokens), after it.
    admitted = [c.admitted for c in clocks]
    assert max(admitted[:2]) < admitted[2] < admitted[3]
    assert clocks[2].queue_ms > clocks[0].queue_ms >= 0
    assert runner.requests_served == 4 and runner.tokens_generated == sum(lengths)
    assert runner.busy_seconds > 0 and runner.active_requests == 0


def test_a_stopped_request_gives_its_slot_to_a_waiting_one(engine, runner, monkeypatch) -> None:
    prompt = engine.encode(PROMPTS[0])
    # Steps of at least 5 ms: the long requests' 100 tokens take 0.5 s, so they still
    # hold both slots when the third request is checked (this 64-wide model made them
    # all in under the 50 ms the check waits on a fast or idle core).
    step = engine.batch.step

    def slow_step():
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine.batch, "step", slow_step)

    async def scenario():
        long_stops = [threading.Event(), threading.Event()]
        streams = [
            runner.generate(runner.parse(prompt, 100, GREEDY), stop, RequestClock())
            for stop in long_stops
        ]
        for stream in streams:
            await anext(stream)  # both slots are now held
        waiting = asyncio.create_task(collect(runner, prompt, 3))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        long_stops[0].set()  # as a cancelled gRPC call does
        tokens = await asyncio.wait_for(waiting, 10)
        await streams[0].aclose()
        await streams[1].aclose()  # closing the generator stops it too
        return tokens

    assert asyncio.run(scenario()) == alone(engine, prompt, 3)
    assert runner.requests_served == 3 and runner.tokens_generated < 200
    assert runner.active_requests == 0


def test_a_failed_step_fails_its_requests_and_the_runner_goes_on(engine, runner, monkeypatch):
    prompt = engine.encode(PROMPTS[1])
    model = engine.batch.model

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(engine.batch, "model", model)
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.batch, "model", fail_once)

    async def scenario():
        with pytest.raises(RuntimeError, match="kernel exploded"):
            await collect(runner, prompt, 4)
        return await collect(runner, prompt, 4)

    assert asyncio.run(scenario()) == alone(engine, prompt, 4)


def test_a_request_failing_alone_ends_with_its_error_and_the_other_goes_on(
    engine, runner, monkeypatch
):
    from monitor_agent.engine.batching import NonFiniteLogits

    prompts = [engine.encode(PROMPTS[0]), engine.encode(PROMPTS[1])]
    expected = alone(engine, prompts[1], 6)
    advance = engine.batch._advance

    def nan_for_the_first_prompt(batch, logits):
        rows = [i for i, h in enumerate(batch) if list(h.request.prompt_ids) == prompts[0]]
        if rows:
            logits = logits.clone()
            logits[rows, 0] = float("nan")
        return advance(batch, logits)

    monkeypatch.setattr(engine.batch, "_advance", nan_for_the_first_prompt)

    async def scenario():
        return await asyncio.gather(
            collect(runner, prompts[0], 6), collect(runner, prompts[1], 6), return_exceptions=True
        )

    failed, served = asyncio.run(scenario())
    assert isinstance(failed, NonFiniteLogits) and served == expected
    assert runner.requests_served == 2 and runner.active_requests == 0


def test_bad_requests_fail_before_they_are_queued(engine, runner) -> None:
    async def scenario():
        with pytest.raises(ValueError, match="prompt is empty"):
            await collect(runner, [], 4)

    asyncio.run(scenario())
    assert runner.active_requests == 0 and runner.requests_served == 0


def test_busy_log_merges_back_to_back_steps_and_measures_a_window() -> None:
    log = BusyLog(max_intervals=2)
    log.record(10.0, 10.5)
    log.record(10.5005, 11.0)  # starts right after: same interval
    log.record(12.0, 12.5)
    assert list(log.intervals) == [(10.0, 11.0), (12.0, 12.5)]
    assert log.total_seconds == pytest.approx(1.4995)
    assert log.busy_fraction(2.0, now=12.5) == pytest.approx((0.5 + 0.5) / 2)
    assert log.busy_fraction(10.0, now=20.0) == pytest.approx(0.15)
    log.record(13.0, 13.5)  # the oldest interval falls out; the total keeps it
    assert len(log.intervals) == 2 and log.total_seconds == pytest.approx(1.9995)


def test_an_unset_max_tokens_is_cut_to_the_room_left_or_says_there_is_none(runner) -> None:
    # 128 positions: a 100-token prompt leaves 28; one of 128 leaves none, and the
    # refusal does not name the max_tokens the client never sent.
    cut = runner.parse([1] * 100, 64, GREEDY, max_tokens_is_bound=True)
    assert cut.max_tokens == 28
    with pytest.raises(ValueError) as refused:
        runner.parse([1] * 128, 64, GREEDY, max_tokens_is_bound=True)
    assert str(refused.value) == (
        "prompt (128 tokens) leaves no room to generate in the 128 positions this "
        "deployment holds per sequence"
    )
    with pytest.raises(ValueError, match="max_tokens"):
        runner.parse([1] * 100, 64, GREEDY)  # set by the client: refused, naming it
