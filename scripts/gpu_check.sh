#!/usr/bin/env bash
# What the GPU machine must confirm after kernel changes, in one device call (about 9 minutes on an
# H200; a warm Triton cache makes it faster). Every step prints one line per test or cell as it goes
# (pytest -v), so a step cut by its timeout still says how far it got.
#   1. install, versions                                                    env.txt
#   2. kernel + HF GPU tests (xdist: compiles run in parallel)              gpu_tests.log
#   3. hardening tests (another process, occupied SMs, 64k, >65535 seqs)     hardening.log, hardening.jsonl
#   4. the causal symmetric shift at the shapes that once hung, each in its own
#      process under a watchdog (scripts/gpu_shift_probe.py)                shift_probe.log
#   5. the benchmark rows the main run leaves out: hdim 256, GQA 4:1         bench/results.{json,md,png}
# Usage (from the repo root): OUT=/some/dir bash scripts/gpu_check.sh [steps, default 12345]
set -o pipefail
OUT=${OUT:-/tmp/dash_gpu_out}; mkdir -p "$OUT"
STEPS=${1:-12345}
export PYTHONUNBUFFERED=1
want() { [[ "$STEPS" == *"$1"* ]]; }
if want 1; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    git log -1 --oneline; } | tee "$OUT/env.txt"
fi
if want 2; then
  timeout "${T2:-200}" python3 -m pytest -v -rA -n "${WORKERS:-6}" -p no:cacheprovider \
      tests/test_gpu_kernels.py tests/test_hf_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" | tail -50
fi
if want 3; then
  DASH_HARDENING_OUT="$OUT" timeout "${T3:-150}" python3 -m pytest -v -rA -s -p no:cacheprovider \
      tests/test_gpu_hardening.py 2>&1 | tee "$OUT/hardening.log" \
    | grep -E "^\[|^(FAILED|ERROR)|[0-9]+ (passed|failed)" | tail -50
fi
if want 4; then
  timeout "${T4:-300}" python3 scripts/gpu_shift_probe.py 60 2>&1 | tee "$OUT/shift_probe.log" | tail -8
fi
if want 5; then
  timeout "${T5:-200}" dash-bench --hdims 256 --gqa --warmup-ms 10 --rep-ms 50 --max-minutes 2.8 \
      --impls 'dash-*,sdpa-flash,sdpa-cudnn,sdpa-det,flex' --out "$OUT/bench" 2>&1 | tail -9
fi
