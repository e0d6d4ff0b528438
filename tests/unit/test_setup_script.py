"""scripts/setup.sh refuses an interpreter it cannot use, saying which and why, before it
touches .venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

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


def test_an_interpreter_that_does_not_run_is_said_so(tmp_path):
    broken = tmp_path / "python3"
    broken.write_text("#!/bin/sh\nexit 127\n")
    broken.chmod(0o755)
    done = run_setup(str(broken))
    assert done.returncode == 1
    assert "is not a Python that runs; iserve needs Python 3.11" in done.stderr, done.stderr


def test_an_interpreter_older_than_3_11_is_refused(tmp_path):
    old = tmp_path / "python3.10"
    # Answers as Python 3.10 would: its version, and the version check failing.
    old.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.10.12"\nexit 1\n')
    old.chmod(0o755)
    done = run_setup(str(old))
    assert done.returncode == 1
    assert "is Python 3.10.12; iserve needs Python 3.11 or newer" in done.stderr
