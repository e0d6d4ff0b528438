"""Stop strings: the scanner (services.stop_strings), and the worker ending a generation
at one (EngineRunner, for either engine) as a finished generation whose slot is free."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from monitor_agent.engine.engine import Engine, SamplingConfig
from monitor_agent.worker.runner import EngineRunner, RequestClock
from services.models.checkpoint import create_checkpoint
from services.stop_strings import StopScanner, check_stop_strings


@given(
    st.lists(st.text(alphabet="abc", max_size=4), max_size=8),
    st.text(alphabet="abc", min_size=1, max_size=3),
)
def test_the_scanner_emits_exactly_the_text_before_the_first_stop(pieces, stop):
    scanner = StopScanner([stop])
    out = ""
    for piece in pieces:
        out += scanner.feed(piece)
        if scanner.stopped:
            break
    if not scanner.stopped:
        out += scanner.flush()
    whole = "".join(pieces)
    expected = whole[: whole.find(stop)] if stop in whole else whole
    assert out == expected
    assert scanner.stopped == (stop in whole)


@pytest.mark.parametrize(
    ("stops", "message"),
    [
        (("a", "b", "c", "d", "e"), "at most 4 stop strings, got 5"),
        (("",), "a stop string has 1 to 1000 characters, got 0"),
        (("x" * 1001,), "a stop string has 1 to 1000 characters, got 1001"),
    ],
)
def test_stop_strings_beyond_the_limits_are_refused(stops, message):
    with pytest.raises(ValueError, match=message):
        check_stop_strings(stops)
    with pytest.raises(ValueError, match=message):
        SamplingConfig(stop_strings=stops)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    checkpoint = create_checkpoint(
        tmp_path_factory.mktemp("stops") / "ckpt",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seed=2,
    )
    return Engine(checkpoint, max_seq_len=128, max_batch=1, num_threads=1)


def test_the_worker_ends_a_generation_at_a_stop_string_and_frees_its_slot(engine):
    """Greedy text of 24 tokens; a stop string taken from its middle ends the second
    generation there: text before it, finish reason "stop", fewer tokens, and the one
    slot free for the next request at once."""
    prompt = engine.encode("The river runs past the old mill")
    free = SamplingConfig(ignore_eos=True)
    whole = "".join(s.text for s in engine.generate(prompt, 24, free))
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    assert len(stop) == 3 and whole.find(stop) > 0
    runner = EngineRunner(engine)
    try:

        async def run(sampling: SamplingConfig):
            steps = runner.generate(
                runner.parse(prompt, 24, sampling), threading.Event(), RequestClock()
            )
            return [s async for s in steps]

        async def both():
            return await run(SamplingConfig(ignore_eos=True, stop_strings=(stop,))), await run(free)

        stopped, after = asyncio.run(both())
    finally:
        runner.close()
        runner._thread.join(timeout=10)
    assert "".join(s.text for s in stopped) == whole[: whole.find(stop)]
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"
    assert len(stopped) < 24
    assert "".join(s.text for s in after) == whole  # the slot was given back
    assert engine.batch.free_slots == 1
