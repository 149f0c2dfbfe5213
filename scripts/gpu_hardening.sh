#!/usr/bin/env bash
# GPU hardening tests (issue #7) on the GPU machine: install, run tests/test_gpu_hardening.py, keep the log,
# the per-case counts (hardening.jsonl) and the per-test durations under OUT_DIR.
# Usage (from the repo root): bash scripts/gpu_hardening.sh OUT_DIR [pytest -k expression]
# Expected: about 3 minutes on an H100 with a warm Triton cache (compiles add about a minute when cold).
set -o pipefail
OUT=${1:?usage: bash scripts/gpu_hardening.sh OUT_DIR [pytest -k expression]}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export DASH_HARDENING_OUT="$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
K=()
if [ -n "$2" ]; then K=(-k "$2"); fi
# -s: the per-case lines and, should anything hang, hang_guard's tracebacks reach the log.
timeout "${TIMEOUT:-600}" python3 -m pytest -q -rA -s --durations=0 -p no:cacheprovider \
    tests/test_gpu_hardening.py "${K[@]}" 2>&1 | tee "$OUT/hardening.log" \
    | grep -E "^\[|^(PASSED|FAILED|ERROR)|passed|failed|[0-9.]+s (call|setup|teardown)"
echo "exit status: ${PIPESTATUS[0]} (124: timed out); counts in $OUT/hardening.jsonl"
