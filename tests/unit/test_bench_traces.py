"""The trace reader of the replay benchmarks: the published forms, and bad files."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import traces
from bench.traces import (
    TraceRow,
    load_trace,
    mean_rate,
    peak_rate,
    spread_times,
    timestamp_resolution_s,
)
from tests.unit.estimator_data import shared_data


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_azure_2023_as_shared():
    directory = shared_data().parent / "azure-llm-traces"
    if not directory.is_dir():
        pytest.skip("the shared traces are not beside this checkout")
    rows = load_trace(directory / "AzureLLMInferenceTrace_code.csv")
    assert len(rows) == 8819
    assert rows[0] == TraceRow(0.0, 4808, 10)
    assert rows[1].arrival_s == pytest.approx(0.052)  # 18:17:04.0319600 - 18:17:03.9799600
    assert 3400 < rows[-1].arrival_s < 3500


def test_azure_2024_with_a_zone_and_six_digit_fractions(tmp_path):
    path = _write(
        tmp_path,
        "AzureLLMInferenceTrace_code_1week.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,2162,5\n"
        "2024-05-10 00:00:01.509930+00:00,1500,27\n",
    )
    assert load_trace(path) == [TraceRow(0.0, 2162, 5), TraceRow(1.5, 1500, 27)]


def test_burstgpt_seconds_and_column_names_with_spaces(tmp_path):
    path = _write(
        tmp_path,
        "BurstGPT_1.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n",
    )
    assert load_trace(path) == [TraceRow(0.0, 472, 18), TraceRow(40.0, 1087, 0)]


def test_mooncake_json_lines_in_milliseconds(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2]},
        {"timestamp": 2500, "input_length": 6472, "output_length": 26, "hash_ids": [3]},
    ]
    path = _write(tmp_path, "mooncake.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    assert load_trace(path, time_unit="ms") == [TraceRow(0.0, 6955, 52), TraceRow(2.5, 6472, 26)]


def test_rows_come_in_arrival_order_and_a_bom_is_no_column(tmp_path):
    path = _write(
        tmp_path,
        "t.csv",
        "\ufeffarrival_time,prompt_tokens,completion_tokens\n3.0,30,3\n1.0,10,1\n2.0,20,2\n",
    )
    assert [r.context_tokens for r in load_trace(path)] == [10, 20, 30]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("when,a,b\n1,2,3\n", "no arrival time column among ['when', 'a', 'b']"),
        ("timestamp,input_tokens\n1,2\n", "no output token column"),
        ("timestamp,input_tokens,output_tokens\n", "t.csv: no requests"),
        ("timestamp,input_tokens,output_tokens\n1,2,3\nyesterday,2,3\n", "t.csv:3: "),
        ("timestamp,input_tokens,output_tokens\n1,-2,3\n", "t.csv:2: input_tokens '-2'"),
        ("timestamp,input_tokens,output_tokens\n1,2,3.5\n", "t.csv:2: output_tokens '3.5'"),
        ("timestamp,input_tokens,output_tokens\nnan,2,3\n", "t.csv:2: timestamp 'nan'"),
        ("timestamp,input_tokens,output_tokens\n1,2\n", "t.csv:2: no output_tokens value"),
        ("timestamp,input_tokens,output_tokens\n1,,3\n", "t.csv:2: no input_tokens value"),
        ("timestamp,input_tokens,output_tokens\n ,2,3\n", "t.csv:2: no timestamp value"),
        ("timestamp,input_tokens,output_tokens\n1,many,3\n", "t.csv:2: input_tokens 'many'"),
        ("timestamp,input_tokens,output_tokens\nnoon,2,3\n", "t.csv:2: timestamp 'noon'"),
    ],
)
def test_bad_files_name_the_file_and_line(tmp_path, text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_trace(_write(tmp_path, "t.csv", text))


def test_bad_json_lines_and_units(tmp_path):
    path = _write(tmp_path, "t.jsonl", '{"timestamp": 1, "input_length": 2, "output_length": 3}\n{')
    with pytest.raises(ValueError, match="t.jsonl:2: not JSON"):
        load_trace(path)
    with pytest.raises(ValueError, match="time_unit"):
        load_trace(path, time_unit="h")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 2, "input_length": 2}', "t.jsonl:2: no output_length value"),
        ('{"timestamp": null, "input_length": 2, "output_length": 3}', "t.jsonl:2: no timestamp"),
        ('{"timestamp": 2, "input_length": [2], "output_length": 3}', "t.jsonl:2: input_length"),
    ],
)
def test_a_missing_json_value_names_its_line_and_column(tmp_path, line, message):
    first = '{"timestamp": 1, "input_length": 2, "output_length": 3}'
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        load_trace(_write(tmp_path, "t.jsonl", f"{first}\n{line}\n"))


def test_a_json_line_nested_too_deeply_is_named_not_a_traceback(tmp_path):
    first = '{"timestamp": 1, "input_length": 2, "output_length": 3}'
    deep = '{"timestamp": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ValueError, match=r"t.jsonl:2: not JSON \(nested too deeply\)"):
        load_trace(_write(tmp_path, "t.jsonl", f"{first}\n{deep}\n"))


def test_a_json_array_is_named_as_such(tmp_path):
    text = json.dumps([{"timestamp": 0, "input_length": 2, "output_length": 3}], indent=1)
    with pytest.raises(ValueError, match="t.json: a JSON array; expected JSON lines"):
        load_trace(_write(tmp_path, "t.json", text))


@pytest.mark.parametrize("arrivals", [[], [0.0], [4.0, 4.0, 4.0]])
def test_rates_need_two_distinct_arrival_times(arrivals):
    for measure in (mean_rate, peak_rate, timestamp_resolution_s):
        with pytest.raises(ValueError, match="needs at least two distinct arrival times"):
            measure(arrivals)


def test_the_peak_rate_of_whole_second_ties_is_measured_over_one_second():
    # 20 requests: the busiest tenth (2) within one second, where 3 share a second.
    arrivals = [0.0, 1.0, 1.0, 1.0] + [float(t) for t in range(3, 19)]
    assert timestamp_resolution_s(arrivals) == 1.0
    assert spread_times(arrivals)[:4] == pytest.approx([0, 1, 4 / 3, 5 / 3])
    assert peak_rate(arrivals) == pytest.approx(3.0)  # 3 a second, not infinitely fast
    assert mean_rate(arrivals) == pytest.approx(19 / 18)
    # Scale-free: stretching the times divides every rate by the stretch.
    assert peak_rate([t * 4 for t in arrivals]) == pytest.approx(0.75)


@pytest.mark.parametrize("per_second", [10, 20, 30, 45])
def test_whole_second_arrivals_peak_at_their_rate(per_second):
    """BurstGPT stamps whole seconds: 30 a second peaked at 19 a second, below their mean
    33, and 10 a second at 19 too (k - 1 over one second, k = 20; a tester)."""
    arrivals = [float(i // per_second) for i in range(per_second * 20)]
    assert peak_rate(arrivals) == pytest.approx(per_second)
    assert mean_rate(arrivals) == pytest.approx(per_second)


def test_a_positive_span_is_never_floored():
    arrivals = [0.0, 0.001, 0.5, 2.0, 2.0005, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert timestamp_resolution_s(arrivals) == pytest.approx(0.0005)
    assert peak_rate(arrivals) == pytest.approx(1 / 0.0005)


@given(
    st.lists(st.integers(0, 10_000), min_size=2, max_size=300).filter(lambda t: len(set(t)) > 1),
    st.sampled_from([1.0, 0.001, 7.5]),
)
@settings(max_examples=300, deadline=None)
def test_ties_are_spread_within_their_step_and_rates_scale_with_the_times(ticks, step):
    arrivals = [t * step for t in ticks]
    spread = spread_times(arrivals)
    resolution = timestamp_resolution_s(arrivals)
    assert all(a < b for a, b in itertools.pairwise(spread))  # distinct, in order
    for time, original in zip(spread, sorted(arrivals), strict=True):
        assert original <= time < original + resolution
    if len(set(arrivals)) == len(arrivals):
        assert spread == sorted(arrivals)
    for rate in (mean_rate, peak_rate):
        assert rate([t * 3 for t in arrivals]) == pytest.approx(rate(arrivals) / 3)


def test_a_csv_row_with_more_fields_than_its_header_is_refused(tmp_path):
    # BurstGPT's columns, and a row whose model name took two fields: its values would
    # land one column to the right (4 prompt tokens, 1087 output tokens).
    path = _write(
        tmp_path,
        "t.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0,ChatGPT,472,18,490,Conversation log\n"
        "1,GPT,4,1087,247,1334,API log\n",
    )
    with pytest.raises(ValueError, match=r"t.csv:3: 7 fields, but the header \(line 1\) names 6"):
        load_trace(path)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("timestamp,input_tokens,output_tokens\n0,1,1\n\n\n1,x,1\n", 5),  # blank lines
        ("timestamp,input_tokens,output_tokens\r\n0,1,1\r\n\r\n1,x,1\r\n", 4),
        ("timestamp,input_tokens,output_tokens\r0,1,1\r\r1,x,1\r", 4),  # old Mac line ends
        ('timestamp,input_tokens,output_tokens,model\n0,1,1,"a\nb\nc"\n1,x,1,c\n', 5),
        ("\n\ntimestamp,input_tokens,output_tokens\n0,1,1\n1,x,1\n", 5),  # before the header
        ("timestamp,input_tokens,output_tokens\n0,1,1\n   \n1,x,1\n", 4),  # spaces only
    ],
)
def test_csv_errors_name_the_line_an_editor_shows(tmp_path, text, line):
    with pytest.raises(ValueError, match=f"t.csv:{line}: input_tokens 'x' is not a token count"):
        load_trace(_write(tmp_path, "t.csv", text))


@pytest.mark.parametrize("separator", ["\u2028", "\x85", "\x0c"])
def test_only_newlines_and_carriage_returns_end_a_csv_line(tmp_path, separator):
    """str.splitlines() also breaks at these; a CSV reader must not, or the row splits."""
    path = _write(
        tmp_path,
        "t.csv",
        f"timestamp,input_tokens,output_tokens,model\n0,1{separator},1,a{separator}b\n1,2,2,c\n",
    )
    assert load_trace(path) == [TraceRow(0.0, 1, 1), TraceRow(1.0, 2, 2)]


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_file_is_named_as_such(tmp_path, text):
    with pytest.raises(ValueError, match="t.csv: the file is empty"):
        load_trace(_write(tmp_path, "t.csv", text))


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            "Timestamp,timestamp,input_tokens,output_tokens",
            "arrival time columns ('Timestamp', 'timestamp')",
        ),
        (
            "timestamp,input_tokens,input_tokens,output_tokens",
            "prompt token columns ('input_tokens', 'input_tokens')",
        ),
        (
            "arrival,timestamp,input_tokens,output_tokens",
            "arrival time columns ('arrival', 'timestamp')",
        ),
    ],
)
def test_two_columns_for_one_value_are_refused(tmp_path, header, message):
    path = _write(tmp_path, "t.csv", f"{header}\n0,100,1,1\n1,200,1,1\n")
    with pytest.raises(ValueError, match=re.escape(f"t.csv: 2 {message}; expected one")):
        load_trace(path)


def test_a_column_mixing_dates_and_numbers_is_refused(tmp_path):
    path = _write(
        tmp_path,
        "t.csv",
        "timestamp,input_tokens,output_tokens\n2024-05-10 00:00:00,1,1\n5,1,1\n",
    )
    with pytest.raises(
        ValueError,
        match="t.csv:3: timestamp '5' is a number, but line 2's is a date and time",
    ):
        load_trace(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (f'{{"timestamp": 0, "input_length": {10**400}, "output_length": 1}}', "input_length "),
        (f'{{"timestamp": {10**400}, "input_length": 1, "output_length": 1}}', "timestamp "),
        ('{"timestamp": 0, "input_length": 1' + "0" * 5000 + ', "output_length": 1}', "not JSON"),
    ],
)
def test_json_integers_too_large_for_a_float_name_the_file_and_line(tmp_path, line, message):
    with pytest.raises(ValueError, match=f"t.jsonl:1: {message}"):
        load_trace(_write(tmp_path, "t.jsonl", line + "\n"))


@pytest.mark.parametrize("separator", ["\u2028", "\x85"])
def test_json_lines_end_only_at_a_newline(tmp_path, separator):
    lines = [
        f'{{"timestamp": 0, "input_length": 1, "output_length": 1, "note": "a{separator}b"}}',
        '{"timestamp": 5, "input_length": 2, "output_length": 2}',
    ]
    path = _write(tmp_path, "t.jsonl", "\r\n".join(lines) + "\r\n")
    assert load_trace(path) == [TraceRow(0.0, 1, 1), TraceRow(5.0, 2, 2)]


def test_a_file_that_cannot_be_read_is_named(tmp_path):
    for path, reason in [
        (tmp_path / "nosuch.csv", "No such file or directory"),
        (tmp_path, "Is a directory"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"{path}: cannot read it ({reason})")):
            load_trace(path)


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ("timestamp,input_tokens,output_tokens\n0,1,1\n1,1,1 café\n".encode("latin-1"), 3),
        ("timestamp,input_tokens,output_tokens\n0,1,1\n".encode("utf-16"), 1),
    ],
)
def test_text_not_in_utf8_is_named_as_such(tmp_path, data, line):
    path = tmp_path / "t.csv"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"t.csv:{line}: not UTF-8 text"):
        load_trace(path)


@pytest.mark.parametrize("name", ["t.csv.gz", "t.csv"])
def test_gzip_compressed_traces_are_read_as_published(tmp_path, name):
    text = "timestamp,input_tokens,output_tokens\n0,10,1\n2,20,2\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode("utf-8")))
    assert load_trace(path) == [TraceRow(0.0, 10, 1), TraceRow(2.0, 20, 2)]


def test_a_damaged_gzip_file_is_named_as_such(tmp_path):
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(b"timestamp,input_tokens,output_tokens\n0,1,1\n")[:20])
    with pytest.raises(ValueError, match="t.csv.gz: gzip data that does not decompress"):
        load_trace(path)


def test_a_gzip_bomb_or_an_oversized_file_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    """Kilobytes of gzip unpacked to gigabytes in memory (a tester); the bound holds
    before and after decompressing. Made small here to stay fast."""
    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 1 << 16)
    header = b"timestamp,input_tokens,output_tokens\n"
    bomb = tmp_path / "bomb.csv.gz"
    bomb.write_bytes(gzip.compress(header + b"0,1,1\n" * 20_000))  # 120 kB unpacked
    assert bomb.stat().st_size < 1 << 12
    with pytest.raises(ValueError, match=r"^bomb\.csv\.gz: more than 0 MiB of trace text"):
        load_trace(bomb)
    plain = tmp_path / "big.csv"
    plain.write_bytes(header + b"0,1,1\n" * 20_000)
    with pytest.raises(ValueError, match=r"^big\.csv: more than 0 MiB of trace text"):
        load_trace(plain)
    fits = tmp_path / "fits.csv.gz"
    fits.write_bytes(gzip.compress(header + b"0,1,1\n1,2,2\n"))
    assert load_trace(fits) == [TraceRow(0.0, 1, 1), TraceRow(1.0, 2, 2)]


def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_trace(fifo)


def test_absurd_rows_are_refused_not_let_stretch_the_replay(tmp_path):
    """A timestamp of 1e308 loaded, and a peak-rate replay put that request 2e306 s
    out, a run that never ends; a count of 10**20 tokens scaled every other row to a
    1-token prompt."""
    rows = [
        '{"timestamp": 0, "input_length": 10, "output_length": 5}',
        '{"timestamp": 1e308, "input_length": 10, "output_length": 5}',
        '{"timestamp": 1000, "input_length": 10, "output_length": 5}',
    ]
    path = _write(tmp_path, "t.jsonl", "\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl: its arrivals span .* more than a year "):
        load_trace(path, time_unit="ms")
    with pytest.raises(ValueError, match=r"\(lines 1 and 2, the earliest and the latest\)"):
        load_trace(path, time_unit="ms")
    huge = '{"timestamp": 0, "input_length": 99999999999999999999, "output_length": 5}'
    with pytest.raises(ValueError, match="t2.jsonl:1: input_length .* beyond any model's"):
        load_trace(_write(tmp_path, "t2.jsonl", huge + "\n"))
    # A day of arrivals, and a prompt of a million tokens, are a trace.
    fine = [
        '{"timestamp": 0, "input_length": 1000000, "output_length": 5}',
        '{"timestamp": 86400000, "input_length": 10, "output_length": 5}',
    ]
    loaded = load_trace(_write(tmp_path, "t3.jsonl", "\n".join(fine) + "\n"), time_unit="ms")
    assert loaded == [TraceRow(0.0, 1_000_000, 5), TraceRow(86400.0, 10, 5)]
