#!/usr/bin/env bash
# README command 1: set up, start the whole stack on this machine (embedded Redis unless
# REDIS_URL is set, every service, one node agent with virtual CPU devices), create a
# small Llama checkpoint, register it, deploy it, stream a generation, show the status,
# then stop everything (KEEP_UP=1 leaves the stack running).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine
export PATH="$PWD/.venv/bin:$PATH"
export ISERVE_STATE_DIR=${ISERVE_STATE_DIR:-$PWD/.state}
export ISERVE_MODELS_ROOT=${ISERVE_MODELS_ROOT:-$ISERVE_STATE_DIR/models}

echo "== iserve up (state in $ISERVE_STATE_DIR)"
iserve down >/dev/null 2>&1 || true
iserve up --detach --devices "${ISERVE_DEVICES:-2}" --device-memory "${ISERVE_DEVICE_MEMORY_GIB:-4}"
[ "${KEEP_UP:-0}" = 1 ] || trap 'echo "== iserve down"; iserve down' EXIT

echo "== iserve model create demo-llama"
iserve model create demo-llama --arch llama --hidden 256 --layers 4 --heads 8 --kv-heads 4 \
  --out "$ISERVE_MODELS_ROOT/demo-llama" --force
echo "== iserve register demo-llama"
iserve register demo-llama demo-llama --skip-profiling
echo "== iserve deploy demo-llama --tp 1 --pp 1"
deployment=$(iserve deploy demo-llama --tp 1 --pp 1 | tail -n 1)
echo "== iserve generate $deployment (random weights: the text is gibberish, the streaming is real)"
iserve generate "$deployment" "Once upon a time" --max-tokens 48 --temperature 0.8 --seed 7
echo "== iserve status"
iserve status
echo "== iserve remove $deployment"
iserve remove "$deployment"
