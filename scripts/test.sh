#!/usr/bin/env bash
# README command 2: set up (with the dev extras) and run lint and the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -k store`.
set -euo pipefail
# Python's UTF-8 mode: file names (this checkout's path among them) are UTF-8 whatever the
# locale says; in a Latin-1 locale pip wrote the launchers with a non-ASCII path mangled.
export PYTHONUTF8=1
cd "$(dirname "$0")/.."
scripts/setup.sh engine,dev
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== pytest"
# pytest-xdist, PYTEST_WORKERS workers (2; 0 runs the tests in this process), each test
# file on one worker so that a module's stack starts once. Most of the suite waits on the
# processes it starts (the serial run keeps one of 2 cores busy), so two workers take
# about 2/3 of the serial time.
# The 20 slowest tests are listed at the end: the suite is kept well under 15 minutes.
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
