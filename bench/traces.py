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
``input_tokens``/``output_tokens`` and ``prompt_tokens``/``completion_tokens`` work too;
two columns that both match one of these (``Timestamp`` and ``timestamp``, or ``arrival``
and ``timestamp``) are refused rather than one picked. A date and time without a zone is
read as UTC (a naive local reading would shift at a daylight-saving change); a column that
mixes dates and times with numbers is refused. Rows are returned in arrival order, times
relative to the first.

Files are UTF-8 text (a byte order mark aside), or gzip-compressed UTF-8 as public traces
are often shipped (read as is, whatever the file's name), of at most MAX_TRACE_BYTES
before and after decompressing (a regular file: a pipe is refused, not waited on).
Blank lines are skipped. A CSV
row with more fields than its header is refused, since its values cannot be placed in
columns. Bad input raises ValueError naming the file, line (as an editor numbers them:
only ``\n``, ``\r\n`` and ``\r`` end a line) and column; a JSON array is refused (one JSON
object per line is what Mooncake publishes).

Rates of a list of arrival times: the mean (first to last) and the peak (the busiest
``PEAK_SHARE`` of them, see :func:`peak_rate`). Neither exists without two distinct
arrival times, and both refuse that with ValueError. Timestamps come in steps of some
resolution (whole seconds in BurstGPT): requests that share a timestamp arrived within
one step of it, not at once, so both rates spread them evenly over that step
(:func:`spread_times`), and stay finite.
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import math
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from services.files import FileTooLarge, NotRegularFile, read_regular_file

__all__ = [
    "PEAK_SHARE",
    "RATE_BASES",
    "TIME_UNITS",
    "TraceRow",
    "load_trace",
    "mean_rate",
    "peak_rate",
    "spread_times",
    "timestamp_resolution_s",
]

TIME_UNITS = {"s": 1.0, "ms": 1e-3}
_ARRIVAL = ("timestamp", "time", "arrivaltime", "arrival")
_PROMPT = ("contexttokens", "requesttokens", "inputlength", "inputtokens", "prompttokens")
_OUTPUT = ("generatedtokens", "responsetokens", "outputlength", "outputtokens", "completiontokens")
# The first bytes of gzip data (RFC 1952), whatever the file is named.
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    context_tokens: int
    generated_tokens: int


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _column(names: list[str], wanted: tuple[str, ...], what: str, source: str) -> str:
    """The one column of ``names`` that ``wanted`` names; ValueError for none or several."""
    matches = [name for name in names if _key(name) in wanted]
    if len(matches) > 1:
        raise ValueError(
            f"{source}: {len(matches)} {what} columns ({', '.join(map(repr, matches))}); "
            "expected one"
        )
    if not matches:
        raise ValueError(
            f"{source}: no {what} column among {names}; expected one of "
            + ", ".join(wanted)
            + " (case, spaces and underscores aside)"
        )
    return matches[0]


def _shown(value: object) -> str:
    """The value's repr, cut short so that an error about it stays one readable line."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _present(value: object, column: str) -> object:
    """The cell's value; ValueError naming the column when it is missing or blank (a short
    CSV row, a JSON object without the key, or null)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"no {column} value")
    return value


# The kinds of timestamp, which one column must not mix: an epoch number beside a date
# would put the two 1.7e9 s apart.
_NUMBER = "a number"
_DATE_TIME = "a date and time"


def _seconds(value: object, column: str, unit: float) -> tuple[float, str]:
    """The timestamp in seconds (a number in ``unit`` seconds, or an ISO 8601 date and
    time, UTC unless it names a zone) and its kind, ``_NUMBER`` or ``_DATE_TIME``."""
    value = _present(value, column)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{column} {_shown(value)} is not a time")
    kind = _NUMBER
    try:
        seconds = float(value) * unit
    except OverflowError:  # an int beyond a float's range, as a string of it reads
        seconds = math.inf
    except ValueError:  # a string, and not a number: a date and time, or neither
        try:
            stamp = datetime.fromisoformat(str(value).strip())
        except ValueError:
            raise ValueError(
                f"{column} {_shown(value)} is neither a number nor an ISO 8601 date and time"
            ) from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=UTC)
        seconds, kind = stamp.timestamp(), _DATE_TIME
    if not math.isfinite(seconds):
        raise ValueError(f"{column} {_shown(value)} is not finite")
    return seconds, kind


# No model's context comes near this many tokens: a count beyond it is a bad row (a
# 99999999999999999999 scaled every other row to a 1-token prompt).
MAX_TRACE_TOKENS = 10_000_000
# The most trace text read, before or after decompressing: BurstGPT's 5.3 million rows
# are about 250 MiB; a gzip file of kilobytes can unpack to gigabytes.
MAX_TRACE_BYTES = 512 << 20
# The longest span a trace's arrivals may cover: the public traces cover hours to days;
# one bad timestamp (1e308) put a request 2e306 s after the others, a replay that never
# ends.
MAX_TRACE_SPAN_S = 366 * 86400.0


def _tokens(value: object, column: str) -> int:
    value = _present(value, column)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{column} {_shown(value)} is not a token count")
    try:
        number = float(value)
    except (OverflowError, ValueError):  # an int beyond a float's range; not a number
        raise ValueError(f"{column} {_shown(value)} is not a token count") from None
    if not (math.isfinite(number) and number >= 0 and number.is_integer()):
        raise ValueError(f"{column} {_shown(value)} is not a token count")
    if number > MAX_TRACE_TOKENS:
        raise ValueError(
            f"{column} {_shown(value)} is beyond any model's context "
            f"(at most {MAX_TRACE_TOKENS:,} tokens)"
        )
    return value if isinstance(value, int) else int(number)


def _text(path: Path) -> str:
    """The file's text: UTF-8, a byte order mark dropped, decompressed first when it is
    gzip data. ValueError naming the file when it cannot be read, is not a regular file,
    holds more than MAX_TRACE_BYTES (compressed or not), or is not UTF-8."""
    too_large = (
        f"{path.name}: more than {MAX_TRACE_BYTES >> 20} MiB of trace text; replay a part "
        "of it (its first rows, or a sample)"
    )
    try:
        data = read_regular_file(path, MAX_TRACE_BYTES)
    except FileTooLarge:
        raise ValueError(too_large) from None
    except NotRegularFile:
        raise ValueError(f"{path}: not a regular file (a pipe or a device)") from None
    except OSError as exc:  # missing, a directory, not permitted
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if data.startswith(_GZIP_MAGIC):
        try:
            # Read to one byte past the bound: a small file may decompress to gigabytes.
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as unpacked:
                data = unpacked.read(MAX_TRACE_BYTES + 1)
        except (OSError, EOFError, zlib.error) as exc:
            raise ValueError(f"{path.name}: gzip data that does not decompress ({exc})") from None
        if len(data) > MAX_TRACE_BYTES:
            raise ValueError(too_large)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path.name}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); the trace "
            "must be saved as UTF-8"
        ) from None


def _json_lines(text: str, source: str) -> tuple[list[str], Iterator[tuple[int, dict]]]:
    """(keys of the first object, (line number, object) pairs) of JSON lines."""
    records = []
    # Only \n ends a JSON line (a \r before it is JSON whitespace): U+2028, U+0085 and
    # the like may stand unescaped inside JSON strings.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:  # also an integer too long to convert
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise ValueError(f"{source}:{number}: not JSON ({reason})") from None
        except RecursionError:  # 100,000 nested brackets: a traceback before
            raise ValueError(f"{source}:{number}: not JSON (nested too deeply)") from None
        if not isinstance(record, dict):
            raise ValueError(f"{source}:{number}: expected a JSON object per line")
        records.append((number, record))
    return list(records[0][1]), iter(records)


def _csv_rows(text: str, source: str) -> Iterator[tuple[int, list[str]]]:
    """(first line number, fields) of each CSV record that is not a blank line."""
    # newline="": the csv module finds the line ends itself (\n, \r\n or \r, and none
    # inside quotes), so its line numbers are the ones an editor shows.
    reader = csv.reader(io.StringIO(text, newline=""))
    end = 0
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise ValueError(f"{source}:{reader.line_num}: not CSV ({exc})") from None
        start, end = end + 1, reader.line_num
        if len(row) > 1 or "".join(row).strip():
            yield start, row


def _csv_records(
    names: list[str], header_line: int, rows: Iterator[tuple[int, list[str]]], source: str
) -> Iterator[tuple[int, dict]]:
    """(line number, record) pairs of the CSV rows under the header ``names``; a short
    row lacks the last columns' values, a long one is refused."""
    for number, row in rows:
        if len(row) > len(names):
            raise ValueError(
                f"{source}:{number}: {len(row)} fields, but the header (line {header_line}) "
                f"names {len(names)} columns"
            )
        yield number, dict(zip(names, row, strict=False))


def _records(path: Path) -> tuple[list[str], Iterator[tuple[int, dict]]]:
    """(column names, (line number, record) pairs) of a CSV or JSON-lines file."""
    text = _text(path)
    opening = text.lstrip()[:1]
    if not opening:
        raise ValueError(f"{path.name}: the file is empty")
    if opening == "[":
        raise ValueError(
            f"{path.name}: a JSON array; expected JSON lines (one object per line, as "
            "Mooncake's traces)"
        )
    if opening == "{":
        return _json_lines(text, path.name)
    rows = _csv_rows(text, path.name)
    header_line, names = next(rows)  # the text is not blank, so some row is not
    return names, _csv_records(names, header_line, rows, path.name)


def load_trace(path: str | Path, time_unit: str = "s") -> list[TraceRow]:
    """The trace's requests in arrival order, arrivals in seconds since the first.

    ``time_unit`` is the unit of numeric timestamps ("s" or "ms"); dates and times are
    read as such. ValueError names the file and line of a bad row, the columns a file
    lacks or has twice, or a file that cannot be read as UTF-8 text.
    """
    path = Path(path)
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {time_unit!r}")
    names, records = _records(path)
    arrival = _column(names, _ARRIVAL, "arrival time", path.name)
    prompt = _column(names, _PROMPT, "prompt token", path.name)
    output = _column(names, _OUTPUT, "output token", path.name)
    rows = []
    lines: dict[int, int] = {}  # id of a row -> its line, to name it in a span error
    first: tuple[str, int] | None = None  # the first timestamp's kind and line
    for number, record in records:
        try:
            seconds, kind = _seconds(record.get(arrival), arrival, TIME_UNITS[time_unit])
            first = first or (kind, number)
            if kind != first[0]:
                raise ValueError(
                    f"{arrival} {_shown(record.get(arrival))} is {kind}, but line {first[1]}'s "
                    f"is {first[0]}; one column cannot mix the two"
                )
            rows.append(
                TraceRow(
                    seconds,
                    _tokens(record.get(prompt), prompt),
                    _tokens(record.get(output), output),
                )
            )
            lines[id(rows[-1])] = number
        except ValueError as exc:
            raise ValueError(f"{path.name}:{number}: {exc}") from None
    if not rows:
        raise ValueError(f"{path.name}: no requests")
    rows.sort(key=lambda row: row.arrival_s)  # stable: ties keep file order
    first = rows[0].arrival_s
    if rows[-1].arrival_s - first > MAX_TRACE_SPAN_S:
        early, late = lines[id(rows[0])], lines[id(rows[-1])]
        raise ValueError(
            f"{path.name}: its arrivals span {rows[-1].arrival_s - first:.3g} s, more than "
            f"a year (lines {early} and {late}, the earliest and the latest): a bad "
            "timestamp, or timestamps in another unit (time_unit)"
        )
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


def spread_times(arrivals: Sequence[float]) -> list[float]:
    """The arrival times, ascending, those that share a time spread evenly over the
    resolution step from it (:func:`timestamp_resolution_s`): m requests stamped t arrived
    somewhere within [t, t + step), so the i-th of them at t + step x i / m. Distinct
    times are kept as they are. ValueError without two distinct times."""
    step_s = timestamp_resolution_s(arrivals)
    counts = Counter(arrivals)
    return [t + step_s * i / m for t, m in sorted(counts.items()) for i in range(m)]


def mean_rate(arrivals: Sequence[float]) -> float:
    """Arrivals per second from the first to the last, ties spread over their step
    (:func:`spread_times`). ValueError without two distinct times."""
    times = spread_times(arrivals)
    return (len(times) - 1) / (times[-1] - times[0])


def peak_rate(arrivals: Sequence[float]) -> float:
    """Arrivals per second over the busiest ``PEAK_SHARE`` of them: (k - 1) / the shortest
    span holding k = max(2, round(PEAK_SHARE x n)) consecutive arrivals, ties spread over
    their step (:func:`spread_times`).

    Requests that share a timestamp arrived within one resolution step of it, not at
    once: 30 requests stamped with each whole second are 30 a second, where measuring k
    of them that share a second as spanning one step read 19 (k - 1 = 19, below their
    mean rate), and 10 a second read 19 too. Times that no two requests share are
    measured as they are. The rate stays finite, and scales with the arrivals:
    multiplying every time by s divides it by s. ValueError without two distinct times.
    """
    times = spread_times(arrivals)
    k = max(2, round(len(times) * PEAK_SHARE))
    shortest = min(times[i + k - 1] - times[i] for i in range(len(times) - k + 1))
    return (k - 1) / shortest


# The rates a load factor can set, by the name ``trace_replay.py --rate-basis`` takes.
RATE_BASES = {"mean": mean_rate, "peak": peak_rate}
