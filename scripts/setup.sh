#!/usr/bin/env bash
# Create .venv (Python 3.11, for the pinned torch 2.13.0 CPU wheel) and install iserve
# into it with the given extras, e.g. `scripts/setup.sh engine,dev`. Idempotent.
set -euo pipefail
# Python's UTF-8 mode: file names (this checkout's path among them) are UTF-8 whatever the
# locale says; in a Latin-1 locale pip wrote the launchers with a non-ASCII path mangled.
export PYTHONUTF8=1
cd "$(dirname "$0")/.."
extras=${1:-engine}
python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
  done
fi
if [ -z "$python" ] || ! command -v "$python" >/dev/null 2>&1; then
  echo "no Python ${python:-(python3.11 or python3)} found: install Python 3.11 (or set PYTHON to one)" >&2
  exit 1
fi
# iserve needs 3.11 or newer (pyproject.toml); the CPU wheel of torch 2.13.0 this machine
# kind keeps on disk is for 3.11.
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  version=$("$python" --version 2>&1 | head -n 1 || true)
  echo "$python is ${version:-not a Python that runs}; iserve needs Python 3.11 or newer (set PYTHON to one)" >&2
  exit 1
fi
if [ -x .venv/bin/python ] && ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo ".venv's Python is older than 3.11: remove .venv and run this again" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
stamp=".venv/.iserve-installed-$extras"
# pip, its output less the warnings of local indexes this machine's pip config names but
# may lack; exits with pip's status (a failed install must not be marked as done).
pip_quietly() {
  local status=0
  .venv/bin/python -m pip "$@" > .venv/pip.log 2>&1 || status=$?
  grep -v "^WARNING: Location" .venv/pip.log || true
  return "$status"
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "== installing iserve[$extras] (torch==2.13.0 CPU comes from the local wheel when present)"
  rm -f "$stamp"
  pip_quietly install -q --upgrade pip || echo "(pip itself was not upgraded; going on)" >&2
  pip_quietly install -q -e ".[$extras]" || { echo "installation of iserve[$extras] failed" >&2; exit 1; }
  .venv/bin/python -c "import services, grpc, torch" || { echo "installation failed" >&2; exit 1; }
  touch "$stamp"
fi
