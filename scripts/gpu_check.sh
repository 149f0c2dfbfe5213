#!/usr/bin/env bash
# What the Triton-kernel engineer runs on the GPU machine: install, GPU tests, first speed figures.
# Usage (from the repo root): OUT=/some/dir bash scripts/gpu_check.sh [pytest -k expression]
set -o pipefail
OUT=${OUT:-/tmp/dash_gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
# Phase 1: determinism (non-cyclic schedules) and atomic-differs; phase 2: speed; phase 3: the rest
# (shift determinism, streams/graphs, features, int64). Each phase under its own timeout.
T="tests/test_gpu_kernels.py"
run_tests() {  # $1 = log name, $2 = timeout, $3 = -k expression
  timeout "$2" python3 -m pytest -q -rA -s "$T" -k "$3" -p no:cacheprovider 2>&1 | grep -v "^$" \
    | tee "$OUT/$1.log" | grep -E "^(PASSED|FAILED|ERROR)|determinism\]|passed|failed" | tail -40
}
run_tests gpu_tests_1 ${T1:-170} "(bitwise and not shift) or atomic_is_not"
timeout ${BENCH_TIMEOUT:-200} python3 scripts/gpu_bench.py "$OUT/kernels-first-figures.json" 2>&1 | tee "$OUT/bench.log" | tail -30
run_tests gpu_tests_2 ${T2:-130} "(bitwise and shift) or two_streams or int64 or agree"
run_tests gpu_tests_3 ${T3:-90} "every_feature"
