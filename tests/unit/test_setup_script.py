"""scripts/setup.sh refuses an interpreter it cannot use, saying which and why, before it
touches .venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def run_setup(python: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SETUP)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": python},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_missing_interpreter_is_named():
    done = run_setup("/nonexistent/python3")
    assert done.returncode == 1
    assert "no Python /nonexistent/python3 found" in done.stderr


@pytest.mark.parametrize(
    ("name", "script", "said"),
    [
        # Does not run at all.
        ("python3", "exit 127", "is not a Python that runs; iserve needs Python 3.11"),
        # Answers as Python 3.10 would: its version, and the version check failing.
        (
            "python3.10",
            '[ "$1" = --version ] && echo "Python 3.10.12"\nexit 1',
            "is Python 3.10.12; iserve needs Python 3.11 or newer",
        ),
    ],
    ids=["not-running", "3.10"],
)
def test_an_interpreter_it_cannot_use_is_refused_saying_why(tmp_path, name, script, said):
    python = tmp_path / name
    python.write_text(f"#!/bin/sh\n{script}\n")
    python.chmod(0o755)
    done = run_setup(str(python))
    assert done.returncode == 1
    assert said in done.stderr, done.stderr
