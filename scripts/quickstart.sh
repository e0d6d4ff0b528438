#!/usr/bin/env bash
# README command 1: set up, start the whole stack on this machine (embedded Redis unless
# REDIS_URL is set, every service, one node agent with virtual CPU devices), create a
# small Llama checkpoint, register it, deploy it, stream a generation (from the CLI, and
# with curl from the OpenAI-compatible gateway), show the status,
# then stop everything (KEEP_UP=1 leaves the stack running).
set -euo pipefail
# Python's UTF-8 mode: file names (this checkout's path among them) are UTF-8 whatever the
# locale says; in a Latin-1 locale pip wrote the launchers with a non-ASCII path mangled.
export PYTHONUTF8=1
# Relative state and models paths are the caller's, as every other command takes them.
for var in ISERVE_STATE_DIR ISERVE_MODELS_ROOT; do
  case "${!var:-/}" in /*) ;; *) export "$var=$PWD/${!var}" ;; esac
done
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
# A second run finds it registered already (the embedded Redis keeps its data in the state dir).
iserve register demo-llama demo-llama --skip-profiling 2>/dev/null \
  || iserve models | grep -E '^demo-llama[[:space:]]' >/dev/null || iserve register demo-llama demo-llama --skip-profiling
echo "== iserve deploy demo-llama --tp 1 --pp 1"
deployment=$(iserve deploy demo-llama --tp 1 --pp 1 | tail -n 1)
echo "== iserve generate $deployment (random weights: the text is gibberish, the streaming is real)"
iserve generate "$deployment" "Once upon a time" --max-tokens 48 --temperature 0.8 --seed 7
gateway=$(python -c 'from services.settings import load_settings; print(load_settings().gateway_address)')
body='{"model": "demo-llama", "messages": [{"role": "user", "content": "Tell me a story"}],
       "max_tokens": 12, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}'
echo "== curl -N http://$gateway/v1/chat/completions (OpenAI-compatible gateway, streamed)"
if command -v curl >/dev/null 2>&1; then
  curl -sSN "http://$gateway/v1/chat/completions" -H 'content-type: application/json' -d "$body"
else
  python - "$gateway" "$body" <<'PY'
import sys, urllib.request
request = urllib.request.Request(f"http://{sys.argv[1]}/v1/chat/completions", sys.argv[2].encode(),
                                 {"content-type": "application/json"})
with urllib.request.urlopen(request) as reply:
    for line in reply:
        print(line.decode(), end="")
PY
fi
echo "== iserve status"
iserve status
echo "== iserve remove $deployment"
iserve remove "$deployment"
