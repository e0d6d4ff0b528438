"""Request traces for replay: arrival time, prompt tokens, output tokens per request.

Reads the public LLM inference traces in the forms they are published in, by their
columns rather than their file names:

=====================  ===============================  ==============================
trace                  columns                          arrival
=====================  ===============================  ==============================
Azure 2023 and 2024    TIMESTAMP, ContextTokens,        date and time, any ISO 8601
                       GeneratedTokens                  form (7-digit fractions, +00:00)
BurstGPT               Timestamp, Request tokens,       seconds (a number)
                       Response tokens
Mooncake (JSON lines)  timestamp, input_length,         milliseconds: ``time_unit="ms"``
                       output_length
=====================  ===============================  ==============================

Column names are matched without regard to case, spaces or underscores, so
``input_tokens``/``output_tokens`` and ``prompt_tokens``/``completion_tokens`` work too.
A date and time without a zone is read as UTC (a naive local reading would shift at a
daylight-saving change). Rows are returned in arrival order, times relative to the first.
Bad input raises ValueError naming the file and line.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["TIME_UNITS", "TraceRow", "load_trace"]

TIME_UNITS = {"s": 1.0, "ms": 1e-3}
_ARRIVAL = ("timestamp", "time", "arrivaltime", "arrival")
_PROMPT = ("contexttokens", "requesttokens", "inputlength", "inputtokens", "prompttokens")
_OUTPUT = ("generatedtokens", "responsetokens", "outputlength", "outputtokens", "completiontokens")


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    context_tokens: int
    generated_tokens: int


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _column(names: list[str], wanted: tuple[str, ...], what: str, source: str) -> str:
    by_key = {_key(name): name for name in names}
    for key in wanted:
        if key in by_key:
            return by_key[key]
    raise ValueError(
        f"{source}: no {what} column among {names}; expected one of "
        + ", ".join(wanted)
        + " (case, spaces and underscores aside)"
    )


def _seconds(value: object, unit: float) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value) * unit
    else:
        text = str(value).strip()
        try:
            seconds = float(text) * unit
        except ValueError:
            stamp = datetime.fromisoformat(text)  # ValueError when neither
            if stamp.tzinfo is None:
                stamp = stamp.replace(tzinfo=UTC)
            seconds = stamp.timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"arrival {value!r} is not finite")
    return seconds


def _tokens(value: object, column: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{column} {value!r} is not a token count")
    number = float(value) if not isinstance(value, int) else value
    if not (math.isfinite(number) and number >= 0 and number == int(number)):
        raise ValueError(f"{column} {value!r} is not a token count")
    return int(number)


def _records(path: Path) -> tuple[list[str], Iterator[tuple[int, dict]]]:
    """(column names, (line number, record) pairs) of a CSV or JSON-lines file."""
    text = path.read_text(encoding="utf-8-sig")
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first.lstrip().startswith("{"):
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path.name}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path.name}:{number}: expected a JSON object per line")
            records.append((number, record))
        names = list(records[0][1]) if records else []
        return names, iter(records)
    reader = csv.DictReader(text.splitlines())
    names = list(reader.fieldnames or [])
    # Line numbers count the header as line 1, as an editor shows them.
    return names, ((number, row) for number, row in enumerate(reader, start=2))


def load_trace(path: str | Path, time_unit: str = "s") -> list[TraceRow]:
    """The trace's requests in arrival order, arrivals in seconds since the first.

    ``time_unit`` is the unit of numeric timestamps ("s" or "ms"); dates and times are
    read as such. ValueError names the file and line of a bad row, or the columns a file
    lacks.
    """
    path = Path(path)
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {time_unit!r}")
    names, records = _records(path)
    arrival = _column(names, _ARRIVAL, "arrival time", path.name)
    prompt = _column(names, _PROMPT, "prompt token", path.name)
    output = _column(names, _OUTPUT, "output token", path.name)
    rows = []
    for number, record in records:
        try:
            rows.append(
                TraceRow(
                    _seconds(record.get(arrival), TIME_UNITS[time_unit]),
                    _tokens(record.get(prompt), prompt),
                    _tokens(record.get(output), output),
                )
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path.name}:{number}: {exc}") from None
    if not rows:
        raise ValueError(f"{path.name}: no requests")
    rows.sort(key=lambda row: row.arrival_s)  # stable: ties keep file order
    first = rows[0].arrival_s
    return [TraceRow(r.arrival_s - first, r.context_tokens, r.generated_tokens) for r in rows]
