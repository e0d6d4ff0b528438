"""bench/trace_replay.py without the stack: what it refuses before starting anything, and
how a load factor sets a window's arrival times."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
# The modules trace_replay.py imports by bare name, as a script run from bench/ does.
SCRIPT_MODULES = ("trace_replay", "traces", "_stack_harness")


@pytest.fixture
def trace_replay(monkeypatch):
    """The script's module, its siblings importable as when it runs, and a stack that
    fails the test if anything starts it."""
    monkeypatch.syspath_prepend(str(BENCH))
    for name in SCRIPT_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("trace_replay")

    def no_stack():
        raise AssertionError("the stack was started")

    monkeypatch.setattr(module.harness, "running_stack", no_stack)
    yield module
    for name in SCRIPT_MODULES:
        sys.modules.pop(name, None)


def _run(monkeypatch, module, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["trace_replay.py", "--traces", "", *argv])
    module.main()


def _trace(path: Path, arrivals: list[float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["timestamp,input_tokens,output_tokens"] + [f"{t},100,10" for t in arrivals]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("arrivals", "requests"),
    [
        ([0.0], 200),  # a one-row trace
        ([5.0, 5.0, 5.0], 200),  # every request at one time
        ([0.0, 1.0, 1.0, 1.0], 2),  # the seeded window (start 1 of 0..2) has one time
        ([0.0, 1.0, 2.0], 1),  # a one-request window
    ],
)
def test_a_window_without_a_span_is_refused_before_the_stack_starts(
    trace_replay, monkeypatch, capsys, tmp_path, arrivals, requests
):
    path = _trace(tmp_path / "flat.csv", arrivals)
    with pytest.raises(SystemExit) as refused:
        _run(monkeypatch, trace_replay, "--trace", str(path), "--requests", str(requests))
    message = str(refused.value.code)
    if requests < 2:  # argparse's refusal, on stderr
        assert "--requests" in capsys.readouterr().err
    else:
        assert "flat.csv" in message
        assert "needs at least two distinct arrival times" in message


def test_two_trace_files_with_one_name_are_refused(trace_replay, monkeypatch, tmp_path):
    first = _trace(tmp_path / "a" / "t.csv", [0.0, 1.0])
    second = _trace(tmp_path / "b" / "t.csv", [0.0, 2.0])
    with pytest.raises(SystemExit, match="t.csv"):
        _run(monkeypatch, trace_replay, "--trace", str(first), "--trace", str(second))


@pytest.mark.parametrize("factors", ["0", "1,-2", "fast"])
def test_load_factors_must_be_positive_numbers(trace_replay, monkeypatch, tmp_path, factors):
    path = _trace(tmp_path / "t.csv", [0.0, 1.0])
    with pytest.raises(SystemExit):
        _run(monkeypatch, trace_replay, "--trace", str(path), "--factors", factors)


def test_peak_basis_sets_whole_second_traces_by_the_load_factor(trace_replay):
    """BurstGPT-style seconds: the busiest tenth (2 of 10) share a second. They are
    spread over it (2 a second), so the factor stretches the gaps instead of every
    request going at t=0."""
    times = [0, 1, 1, 2, 5, 8, 9, 9, 12, 15]
    window = [trace_replay.harness.Job(float(t), 100, 10) for t in times]
    for rate_per_s in (0.5, 1.0, 2.0):
        jobs = trace_replay.at_rate(window, rate_per_s, "peak")
        assert [j.at_s for j in jobs] == pytest.approx([t * 2 / rate_per_s for t in times])
    mean = trace_replay.at_rate(window, 1.0, "mean")
    assert [j.at_s for j in mean] == pytest.approx([t * 9 / 15 for t in times])


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--repeats", "0"),
        ("--repeats", "-1"),
        ("--batch", "0"),
        ("--max-input", "0"),
        ("--max-output", "-3"),
        ("--ttft-slo-ms", "-1"),
        ("--slo-multiple", "0"),
        ("--timeout-s", "nan"),
    ],
)
def test_numbers_out_of_range_are_refused_before_the_stack_starts(
    trace_replay, monkeypatch, capsys, tmp_path, flag, value
):
    path = _trace(tmp_path / "t.csv", [0.0, 1.0])
    with pytest.raises(SystemExit):
        _run(monkeypatch, trace_replay, "--trace", str(path), flag, value)
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and repr(value) in err, err


def test_a_trace_that_cannot_be_read_is_named_before_the_stack_starts(
    trace_replay, monkeypatch, tmp_path
):
    for path in (tmp_path / "nosuch.csv", tmp_path):
        with pytest.raises(SystemExit, match=re.escape(f"{path}: cannot read it")):
            _run(monkeypatch, trace_replay, "--trace", str(path))
    argv = ["trace_replay.py", "--traces-dir", str(tmp_path), "--traces", "nosuch"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match="AzureLLMInferenceTrace_nosuch.csv: cannot read it"):
        trace_replay.main()


def test_every_whole_window_can_be_drawn(trace_replay):
    """Windows of 2 of the rows at 0, 1 and 3 s start at the first row or the second (the
    last whole window): their spans are 1 s and 2 s."""
    rows = [trace_replay.TraceRow(t, 100, 10) for t in (0.0, 1.0, 3.0)]
    spans = {trace_replay.window_jobs(rows, 2, seed, 512, 128)[-1].at_s for seed in range(32)}
    assert spans == {1.0, 2.0}


def test_zero_token_rows_are_replayed_as_one_token_and_said_so(trace_replay, capsys):
    """A probe: zero-length outputs and prompts were replayed as 1 token without a word."""
    import argparse

    rows = [trace_replay.TraceRow(t, n, m) for t, n, m in ((0.0, 0, 10), (1.0, 100, 0))]
    args = argparse.Namespace(requests=2, seed=0, max_input=512, max_output=128)
    [jobs] = trace_replay.windows({"zeros.csv": rows}, args).values()
    assert [(j.prompt_tokens, j.output_tokens) for j in jobs] == [(1, 128), (512, 1)]
    err = capsys.readouterr().err
    assert "trace zeros.csv: 1 prompt(s) and 1 output(s) of 0 tokens" in err
