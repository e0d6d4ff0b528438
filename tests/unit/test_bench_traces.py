"""The trace reader of the replay benchmarks: the published forms, and bad files."""

from __future__ import annotations

import json

import pytest

from bench.traces import TraceRow, load_trace
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
        ("timestamp,input_tokens,output_tokens\nnan,2,3\n", "t.csv:2: arrival 'nan'"),
        ("timestamp,input_tokens,output_tokens\n1,2\n", "t.csv:2: "),
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
