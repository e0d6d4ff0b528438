#!/usr/bin/env bash
# Create .venv (Python 3.11, for the pinned torch 2.13.0 CPU wheel) and install iserve
# into it with the given extras, e.g. `scripts/setup.sh engine,dev`. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-engine}
python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
  done
fi
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
stamp=".venv/.iserve-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "== installing iserve[$extras] (torch==2.13.0 CPU comes from the local wheel when present)"
  # This machine's pip config names local indexes that may be absent; hide that noise.
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -e ".[$extras]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import services, grpc, torch" || { echo "installation failed" >&2; exit 1; }
  touch "$stamp"
fi
