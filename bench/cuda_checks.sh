#!/usr/bin/env bash
# The CUDA paths, in one go, on a machine with an NVIDIA GPU (CI has none):
#   1. the engine on CUDA against the CPU, and the whole stack on the GPUs: NVML discovery
#      and the monitor's measured use, a deployment streaming from a GPU in the
#      checkpoint's dtype, a profiling job (tests/gpu);
#   2. estimation accuracy on one GPU by the CPU bench's method (bench/estimate_cpu.py:
#      three 24-layer families in bfloat16, fingerprints then full models at (1,1),
#      batch 1 and 2 fingerprints, two passes for the repeatability floor);
#   3. worker start-up on CUDA, fresh process against the warm pool (bench/worker_startup.py).
# Usage: bench/cuda_checks.sh [OUT_DIR]   (default $OUT, else /tmp/iserve-cuda)
# Needs python3 (or $PYTHON) with the project's requirements and a CUDA build of torch.
# OUT_DIR gets each step's output, the bench's raw measurements (estimate_cuda_raw.json:
# `bench/estimate_cpu.py --load` redoes the estimates from it anywhere) and every
# process's log (logs.tgz); checkpoints and stack state stay in $WORK_DIR. A failed or
# timed-out step does not stop the next; the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/iserve-cuda}}
work=${WORK_DIR:-/tmp/iserve-cuda-work}
mkdir -p "$out" "$work"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
"$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' \
  || exit 1

echo "== 1. tests/gpu"
timeout "${TESTS_TIMEOUT_S:-150}" "$py" -m pytest -q -p no:cacheprovider tests/gpu \
  --basetemp="$work/pytest" 2>&1 | tee "$out/gpu_tests.txt" || status=1

echo "== 2. estimation on one GPU"
timeout "${ESTIMATE_TIMEOUT_S:-360}" "$py" bench/estimate_cpu.py --devices 1 --dtype bfloat16 \
  --hidden "${HIDDEN:-2048}" --save "$out/estimate_cuda_raw.json" --state-dir "$work/estimate" \
  2> "$out/estimate_cuda.log" | tee "$out/estimate_cuda.txt" || status=1
tail -n 5 "$out/estimate_cuda.log"

echo "== 3. worker start-up on CUDA"
timeout "${STARTUP_TIMEOUT_S:-60}" "$py" bench/worker_startup.py --device cuda \
  --rounds "${STARTUP_ROUNDS:-3}" 2>&1 | tee "$out/worker_startup.txt" || status=1

# Every process's log in one file (a machine may send back only a few files).
(cd "$work" && find . -path '*logs*' -name '*.log' -print0 | tar -czf "$out/logs.tgz" --null -T -)
exit $status
