"""services.cli.output: rich on a terminal, plain aligned text otherwise."""

from __future__ import annotations

import io

from rich.console import Console

from services.cli.output import plain_table, show_tables

TABLES = [(None, ["NAME", "STATE", "FREE MiB"], [["dep-a", "READY", 512], ["dep-b", "FAILED", 7]])]


def test_plain_text_is_aligned_columns_without_colour_or_boxes(capsys):
    show_tables(TABLES, Console(file=io.StringIO(), force_terminal=False))
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "NAME   STATE   FREE MiB",
        "dep-a  READY   512",
        "dep-b  FAILED  7",
    ]
    assert "\x1b[" not in out
    assert plain_table(["A"], []) == "A"


def test_a_terminal_gets_a_rich_table_with_coloured_states():
    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, color_system="standard", width=60)
    show_tables(TABLES, terminal)
    out = buffer.getvalue()
    assert "\x1b[" in out and "─" in out  # colours and box lines
    assert "READY" in out and "FAILED" in out and "dep-b" in out
