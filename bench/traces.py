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
Bad input raises ValueError naming the file, line and column; a JSON array is refused
(one JSON object per line is what Mooncake publishes).

Rates of a list of arrival times: the mean (first to last) and the peak (the busiest
``PEAK_SHARE`` of them, see :func:`peak_rate`). Neither exists without two distinct
arrival times, and both refuse that with ValueError. Timestamps come in steps of some
resolution (whole seconds in BurstGPT), and a span shorter than that step is not
measurable: requests that share a timestamp arrived within one step, not at once, so the
peak rate measures such a span as one step and stays finite.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = [
    "PEAK_SHARE",
    "RATE_BASES",
    "TIME_UNITS",
    "TraceRow",
    "load_trace",
    "mean_rate",
    "peak_rate",
    "timestamp_resolution_s",
]

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


def _present(value: object, column: str) -> object:
    """The cell's value; ValueError naming the column when it is missing or blank (a short
    CSV row, a JSON object without the key, or null)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"no {column} value")
    return value


def _seconds(value: object, column: str, unit: float) -> float:
    value = _present(value, column)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{column} {value!r} is not a time")
    try:
        seconds = float(value) * unit
    except ValueError:  # a string, and not a number: a date and time, or neither
        try:
            stamp = datetime.fromisoformat(str(value).strip())
        except ValueError:
            raise ValueError(
                f"{column} {value!r} is neither a number nor an ISO 8601 date and time"
            ) from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=UTC)
        seconds = stamp.timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"{column} {value!r} is not finite")
    return seconds


def _tokens(value: object, column: str) -> int:
    value = _present(value, column)
    if isinstance(value, bool):
        raise ValueError(f"{column} {value!r} is not a token count")
    try:
        number = value if isinstance(value, int) else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{column} {value!r} is not a token count") from None
    if not (math.isfinite(number) and number >= 0 and number == int(number)):
        raise ValueError(f"{column} {value!r} is not a token count")
    return int(number)


def _records(path: Path) -> tuple[list[str], Iterator[tuple[int, dict]]]:
    """(column names, (line number, record) pairs) of a CSV or JSON-lines file."""
    text = path.read_text(encoding="utf-8-sig")
    first = next((line for line in text.splitlines() if line.strip()), "").lstrip()
    if first.startswith("["):
        raise ValueError(
            f"{path.name}: a JSON array; expected JSON lines (one object per line, as "
            "Mooncake's traces)"
        )
    if first.startswith("{"):
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
                    _seconds(record.get(arrival), arrival, TIME_UNITS[time_unit]),
                    _tokens(record.get(prompt), prompt),
                    _tokens(record.get(output), output),
                )
            )
        except ValueError as exc:
            raise ValueError(f"{path.name}:{number}: {exc}") from None
    if not rows:
        raise ValueError(f"{path.name}: no requests")
    rows.sort(key=lambda row: row.arrival_s)  # stable: ties keep file order
    first = rows[0].arrival_s
    return [TraceRow(r.arrival_s - first, r.context_tokens, r.generated_tokens) for r in rows]


# The busiest part of a list of arrivals that its peak rate describes: a tenth of them.
PEAK_SHARE = 0.1


def _distinct_times(arrivals: Sequence[float]) -> list[float]:
    """The distinct arrival times, ascending; ValueError when fewer than two, since no
    rate can be measured without a span."""
    times = sorted(set(arrivals))
    if len(times) < 2:
        held = {0: "it has none", 1: "it has one"}.get(
            len(arrivals), f"its {len(arrivals)} arrivals share one time"
        )
        raise ValueError(f"needs at least two distinct arrival times to have a rate; {held}")
    return times


def timestamp_resolution_s(arrivals: Sequence[float]) -> float:
    """The smallest positive gap between two arrival times, in seconds: the finest step the
    timestamps are seen to take (1.0 for whole-second timestamps as soon as two requests
    arrive a second apart). ValueError without two distinct times."""
    return min(later - earlier for earlier, later in itertools.pairwise(_distinct_times(arrivals)))


def mean_rate(arrivals: Sequence[float]) -> float:
    """Arrivals per second from the first to the last. ValueError without two distinct
    times."""
    times = _distinct_times(arrivals)
    return (len(arrivals) - 1) / (times[-1] - times[0])


def peak_rate(arrivals: Sequence[float]) -> float:
    """Arrivals per second over the busiest ``PEAK_SHARE`` of them: (k - 1) / the shortest
    span holding k = max(2, round(PEAK_SHARE x n)) consecutive arrivals.

    A span shorter than :func:`timestamp_resolution_s` counts as one resolution step: k
    requests sharing a timestamp arrived somewhere within that step, not at once. Only a
    span of zero changes (a positive span holds at least one gap, so is at least the
    resolution), and the rate stays finite, so stretching the arrivals sets it. The rate
    scales with the arrivals: multiplying every time by s divides it by s. ValueError
    without two distinct times.
    """
    resolution_s = timestamp_resolution_s(arrivals)
    ordered = sorted(arrivals)
    k = max(2, round(len(ordered) * PEAK_SHARE))
    shortest = min(ordered[i + k - 1] - ordered[i] for i in range(len(ordered) - k + 1))
    return (k - 1) / max(shortest, resolution_s)


# The rates a load factor can set, by the name ``trace_replay.py --rate-basis`` takes.
RATE_BASES = {"mean": mean_rate, "peak": peak_rate}
