#!/usr/bin/env bash
# README command 2: set up (with the dev extras) and run lint and the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -k store`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine,dev
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== pytest"
.venv/bin/python -m pytest "$@"
