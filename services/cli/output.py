"""How the CLI shows things: on a terminal, rich tables, progress bars and colours; when
stdout is not a terminal (a pipe, a file, a test), the same tables as plain aligned
text with no colour or box characters; with ``--json``, JSON (each command's own).

rich (https://github.com/Textualize/rich) does the terminal side: it measures the
terminal, wraps cells, colours states and redraws ``iserve status --watch`` in place.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

# Cell values drawn in colour on a terminal.
STYLES = {
    "serving": "green",
    "READY": "green",
    "PROFILED": "green",
    "REGISTERED": "cyan",
    "STARTING": "yellow",
    "PROFILING": "yellow",
    "DEGRADED": "yellow",
    "DOWN": "bold red",
    "FAILED": "bold red",
    "STOPPED": "dim",
}

TableSpec = tuple[str | None, Sequence[str], Sequence[Sequence[object]]]


def gib(value: float) -> str:
    """A GiB figure for a table: two decimals from 1 GiB up, three significant digits
    below (a small model's 4.7 MB of memory read "0.00" in every row, so rows could not
    be compared)."""
    return f"{value:.2f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def stdout_is_terminal() -> bool:
    return console().is_terminal


def call_showing_status(
    call: Any,
    request: Any,
    err: Console,
    describe: Callable[[float], str],
    *,
    poll_s: float = 1.0,
) -> Any:
    """``call(request)`` (a unary gRPC method of a blocking stub). On a terminal the call
    runs in the background while a status line on ``err`` shows ``describe(elapsed_s)``,
    asked again every ``poll_s`` (a Deploy that loads a large model takes minutes, and
    nothing on the screen said it was still at work); Ctrl-C cancels the call, as it
    does the blocking one. Elsewhere (a pipe, a file, a script) the plain blocking call:
    ``err`` must be a terminal in fact, not only by FORCE_COLOR, whose redraws would fill
    a CI log with a frame every tenth of a second (a tester: 8 KB in 4 s)."""
    isatty = getattr(err.file, "isatty", None)
    if not (err.is_terminal and isatty is not None and isatty()):
        return call(request)
    future = call.future(request)
    ended = threading.Event()
    future.add_done_callback(lambda _: ended.set())
    started = time.monotonic()
    try:
        with err.status(describe(0.0)) as status:
            while not ended.wait(poll_s):
                status.update(describe(time.monotonic() - started))
    except KeyboardInterrupt:
        future.cancel()
        raise
    return future.result()


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned with spaces, headers first: what scripts and tests read."""
    every = [list(map(str, headers)), *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in every) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in every
    )


def rich_table(
    title: str | None,
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    compact: bool = False,
) -> Table:
    """``compact``: no box lines between the columns (three characters a column)."""
    table = Table(
        title=title,
        title_justify="left",
        header_style="bold",
        pad_edge=False,
        box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD,
        show_edge=not compact,
    )
    for i, header in enumerate(headers):
        numeric = any(word in header for word in ("MiB", "GiB", " ms", "TP", "PP", "BATCH", "LOAD"))
        table.add_column(
            header,
            justify="right" if numeric else "left",
            overflow="fold",
            # The first column names the row (a model, deployment or node id): whole,
            # so it can be copied, however narrow the terminal; the others give way.
            no_wrap=i == 0,
            min_width=len(header) if i == 0 else None,
        )
    for row in rows:
        cells = [str(c) for c in row]
        table.add_row(*(f"[{STYLES[c]}]{c}[/]" if c in STYLES else c for c in cells))
    return table


def fitted(table: TableSpec, out: Console) -> RenderableType:
    """``table`` as wide as the terminal allows without cutting a value: boxed, else
    without the lines between columns, else plain aligned text whose long lines the
    terminal wraps. rich folds a cell narrower than its value mid-word: at 80 columns
    `iserve status` showed an address over four lines and READY as READ/Y."""
    title, headers, rows = table
    unbounded = out.options.update_width(1 << 16)  # a table's natural width, not the terminal's
    for compact in (False, True):
        candidate = rich_table(title, headers, rows, compact)
        if Measurement.get(out, unbounded, candidate).maximum <= out.width:
            return candidate
    text = plain_table(headers, rows)
    if max(map(len, text.splitlines())) > out.width:
        # Wrapped lines of a table read as noise (at 80 columns the node and deployment
        # tables of `iserve status` were 94-108 wide): a block of lines per row instead.
        text = record_table(headers, rows, out.width)
    return Text((f"{title}\n" if title else "") + text, no_wrap=True, overflow="ignore")


def record_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], width: int | None = None
) -> str:
    """Each row as a block of ``HEADER  value`` lines, a blank line between rows. A
    comma-separated value longer than ``width`` allows goes on after a comma on lines of
    its own, under the value (a device's 111-character list of deployments was one line
    the terminal wrapped mid-id); an id is never cut."""
    label = max(map(len, headers))
    room = None if width is None else max(1, width - label - 2)
    lines = []
    for r in rows:
        block = []
        for h, c in zip(headers, r, strict=True):
            first, *rest = _after_commas(str(c), room)
            block.append(f"{h.ljust(label)}  {first}".rstrip())
            block.extend(f"{'':{label}}  {part}" for part in rest)
        lines.append("\n".join(block))
    return "\n\n".join(lines)


def _after_commas(value: str, room: int | None) -> list[str]:
    """``value`` in lines of at most ``room`` characters, broken only after commas."""
    if room is None or len(value) <= room or "," not in value:
        return [value]
    parts = [p + "," for p in value.split(",")]
    parts[-1] = parts[-1][:-1]
    out = [""]
    for part in parts:
        if out[-1] and len(out[-1]) + len(part) > room:
            out.append("")
        out[-1] += part
    return out


def narrowed(table: TableSpec, width: int, optional: Sequence[str]) -> tuple[TableSpec, list[str]]:
    """``table`` without as many of its ``optional`` columns, dropped in that order, as
    its aligned text needs to fit ``width`` (every one of them when it never does), and
    the headers dropped. The first column, which names the row, always stays."""
    title, headers, rows = table
    headers, rows = list(headers), [list(r) for r in rows]
    dropped: list[str] = []
    for header in optional:
        if max(map(len, plain_table(headers, rows).splitlines())) <= width:
            break
        if header in headers[1:]:
            at = headers.index(header, 1)
            dropped.append(headers.pop(at))
            for row in rows:
                row.pop(at)
    return (title, headers, rows), dropped


def renderable(
    tables: Sequence[TableSpec], out: Console | None = None, optional: Sequence[str] = ()
) -> Group:
    """The tables fitted to the terminal, a blank line between them. Headers in
    ``optional`` (a view redrawn in place, which a table's rows turned into blocks of
    lines would push off the screen) are left out, in that order, until a table fits
    the width, and a line under the table names them (under the last table, a 24-line
    screen cut it off: a probe)."""
    out = out or console()
    parts: list[RenderableType] = []
    for table in tables:
        dropped: list[str] = []
        if optional:
            table, dropped = narrowed(table, out.width, optional)
        if parts:
            parts.append(Text(""))
        parts.append(fitted(table, out))
        if dropped:
            said = f"left out at {out.width} columns: {', '.join(dropped)}"
            parts.append(Text(said, style="dim"))
    return Group(*parts)


def show_tables(tables: Sequence[TableSpec], out: Console | None = None) -> None:
    """Rich tables on a terminal, plain aligned text otherwise (a blank line between)."""
    out = out or console()
    if out.is_terminal:
        out.print(renderable(tables, out), crop=False)
        return
    chunks = []
    for title, headers, rows in tables:
        chunks.append((f"{title}\n" if title else "") + plain_table(headers, rows))
    sys.stdout.write("\n\n".join(chunks) + "\n")
