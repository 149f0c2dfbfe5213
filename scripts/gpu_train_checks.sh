#!/usr/bin/env bash
# Issue #6's GPU checks in one run on a machine with two GPUs (nvidia-h200-x2), about 7-8 minutes:
#   a) install, nvidia-smi, versions                                                       (~15 s)
#   b) two-GPU runs bit-identical: DDP and FSDP2 (tests/test_repro_gpu.py -k two_gpu)       (~1.5-2.5 min)
#   c) 200 steps at seqlen 4096 on one GPU, twice, in parallel (run1 on GPU 0, run2 on GPU 1),
#      compared and plotted; then the same pair with the atomic schedule for 20 steps       (~1.5-2.5 min)
#   d) the Hugging Face Trainer, two runs on the GPU (tests/test_repro_trainer.py -k gpu)   (~30-60 s)
#   e) end-to-end speed on GPU 0: scripts/gpu_e2e_speed.py (the 1b model, 4k and 8k)        (~2-3 min)
# Each step runs under its own timeout, and all of them within BUDGET seconds (default 575) so the whole
# script ends inside one 10-minute device command; a step that would start too late is skipped.
#
# Usage, from the repository root:  OUT=/some/dir bash scripts/gpu_train_checks.sh
# Knobs: STEPS=abcde (which steps), BUDGET, PY (default python3), WORK (run directories, not in OUT),
#        C_SIZE/C_SEQ/C_BATCH/C_STEPS/C_ATOMIC_STEPS for step c.
# Files in $OUT (few, flat): summary.txt (PASS/FAIL lines), checks.log (everything), repro_det_4k.png,
# repro_atomic_4k.png, e2e_speed.json, e2e_speed.md.
set -u -o pipefail
OUT=${OUT:-/tmp/dash_train_checks}
WORK=${WORK:-/tmp/dash_train_work}
PY=${PY:-python3}
STEPS=${STEPS:-abcde}
BUDGET=${BUDGET:-575}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/checks.log"
SUM="$OUT/summary.txt"
: > "$LOG"
: > "$SUM"
export PYTHONUNBUFFERED=1
# NVLink multicast off (the machine's notes ask for it); NCCL's algorithm pinned for the two-GPU runs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_ALGO=Ring
START=$(date +%s)

elapsed() { echo $(( $(date +%s) - START )); }
want() { [[ "$STEPS" == *"$1"* ]]; }
section() { echo "===== $* ($(date +%T), $(elapsed) s in) =====" | tee -a "$LOG"; }
say() { echo "$*" | tee -a "$SUM"; }

# run_step LIMIT CMD...: CMD under a timeout of LIMIT seconds (less if the budget is nearly spent), its
# output appended to checks.log (live) and kept in $WORK/last.out. SIGINT first, so dash-repro and pytest
# stop the training processes they started; SIGKILL 20 s later. Returns CMD's exit code (124: timed out,
# 125: not started, the budget was spent).
run_step() {
  local limit=$1; shift
  local left=$(( BUDGET - $(elapsed) ))
  (( left < limit )) && limit=$left
  if (( limit < 15 )); then
    echo "(not started, budget spent: $*)" | tee -a "$LOG" > "$WORK/last.out"
    return 125
  fi
  echo "\$ $* (timeout ${limit} s)" >> "$LOG"
  local t0=$(date +%s)
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$LOG" > "$WORK/last.out"
  local rc=${PIPESTATUS[0]}
  echo "[exit $rc after $(( $(date +%s) - t0 )) s]" >> "$LOG"
  (( rc == 124 )) && stop_leftovers
  return "$rc"
}

# After a step that timed out: training processes live in their own sessions (dash-repro starts them so),
# out of timeout's reach if their parent could not stop them. Stop the GPU processes left behind, by PID, so
# the next step gets idle GPUs (every GPU process on this machine was started by this script).
stop_leftovers() {
  local pids ids=()
  # With a side job on GPU 1 (SIDE_GPU1), only GPU 0's processes are this step's.
  [[ -n "${SIDE_PID:-}" ]] && ids=(--id=0)
  pids=$(nvidia-smi "${ids[@]}" --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [[ -z "$pids" ]] && return 0
  echo "GPU processes left after the timeout, stopped: $pids" | tee -a "$LOG"
  for pid in $pids; do kill -9 "$pid" 2>/dev/null; done
  sleep 2
}

# verdict NAME RC: a PASS/FAIL/TIMEOUT line in summary.txt for exit code RC (0 = pass).
verdict() {
  local name=$1 rc=$2 what
  case $rc in
    0) what=PASS ;;
    3) what="FAIL (tests skipped: no evidence)" ;;
    124) what="FAIL (timed out)" ;;
    125) what="SKIPPED (time budget spent)" ;;
    *) what="FAIL (exit $rc)" ;;
  esac
  say "$what: $name [at $(elapsed) s]"
}

pytest_line() {  # the final pytest summary line of the last step, e.g. "2 passed in 95.1s"
  grep -E "[0-9]+ (passed|failed|skipped|error)" "$WORK/last.out" | tail -1 | sed 's/^=* *//; s/ *=*$//'
}

run_summary() {  # figures of a dash-repro run directory pair, from the runs' own logs
  "$PY" - "$1" <<'EOF'
import json, statistics, sys
from pathlib import Path
for run in ("run1", "run2"):
    d = Path(sys.argv[1]) / run
    try:
        meta = json.loads((d / "meta.json").read_text())
        steps = [json.loads(line) for line in open(d / "steps.jsonl")]
        where = (d / "train.log").read_text().split("\n", 1)[0].split(" ", 2)[1]  # "$ CUDA_VISIBLE_DEVICES=N ..."
    except (OSError, ValueError, IndexError) as e:
        print(f"  {run}: no figures ({e})")
        continue
    steady = steps[5:] or steps  # the first steps include compilation
    tps = statistics.median(s["tokens_per_s"] for s in steady)
    mfu = [s["mfu"] for s in steady if s.get("mfu")]
    mfu_text = f"MFU {statistics.median(mfu) * 100:.1f}%" if mfu else "MFU -"
    print(f"  {run}: {where} {meta.get('device_name')}, {len(steps)} steps, median {tps:,.0f} tokens/s, "
          f"{mfu_text}; attention: {meta.get('dash_resolved')}")
EOF
}

# ------------------------------------------------------------------------------------------ a) set-up
section "a) install and versions"
if want a; then
  run_step 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  verdict "a) pip install -e ." $?
fi
nvidia-smi >> "$LOG" 2>&1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG" "$SUM"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG" "$SUM"
import sys, torch, transformers, accelerate
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = None
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}), triton {tv}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, {torch.cuda.device_count()} GPUs")
EOF
git log -1 --oneline 2>/dev/null | sed 's/^/commit /' | tee -a "$LOG" "$SUM"

# ------------------------------------------------------------------------------------------ b) DDP / FSDP
if want b; then
  section "b) two GPUs: DDP and FSDP2 runs bit-identical"
  run_step 200 "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_repro_gpu.py -k two_gpu
  rc=$?
  line=$(pytest_line)
  [[ $rc == 0 && "$line" == *skipped* ]] && rc=3  # a skip is no evidence
  verdict "b) accelerate launch --num_processes 2, DDP and FSDP2, two runs bit-identical: $line" $rc
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$WORK/last.out" | sed 's/^/    /' | tee -a "$SUM" > /dev/null
fi

# ------------------------------------------------------------------------------------------ side job
# SIDE_GPU1="cmd": after the two-GPU step, run cmd in the background on GPU 1 (e.g. the benchmark)
# while steps c-e use GPU 0 only (then set C_DEVICES=0,0); its output goes to checks.log at the end.
if [[ -n "${SIDE_GPU1:-}" ]]; then
  section "side job on GPU 1: $SIDE_GPU1"
  ( CUDA_VISIBLE_DEVICES=1 timeout -s INT -k 20 $(( BUDGET - $(elapsed) - 15 )) bash -c "$SIDE_GPU1" \
      > "$WORK/side_gpu1.log" 2>&1; echo "[side job exit $?]" >> "$WORK/side_gpu1.log" ) &
  SIDE_PID=$!
fi

# ------------------------------------------------------------------------------------------ c) 200 steps at 4k
if want c; then
  section "c) seqlen ${C_SEQ:-4096}, two runs in parallel (CUDA_VISIBLE_DEVICES ${C_DEVICES:-0,1})"
  C_ARGS=(--size "${C_SIZE:-base}" --seq-len "${C_SEQ:-4096}" --batch-size "${C_BATCH:-4}")
  rm -rf "$WORK/det4k" "$WORK/atomic4k"
  run_step 240 "$PY" -m dash_plugin.repro run --parallel --devices "${C_DEVICES:-0,1}" --out "$WORK/det4k" "${C_ARGS[@]}" \
    --steps "${C_STEPS:-200}"
  rc=$?
  verdict "c) ${C_ARGS[*]} --steps ${C_STEPS:-200}, deterministic (auto), run1 on GPU 0 / run2 on GPU 1: $(grep -E '^(IDENTICAL|DIFFERENT)' "$WORK/last.out" | tail -1)" $rc
  run_summary "$WORK/det4k" 2>&1 | tee -a "$LOG" "$SUM"
  if [[ -s "$WORK/det4k/run1/steps.jsonl" && -s "$WORK/det4k/run2/steps.jsonl" ]]; then
    run_step 60 "$PY" -m dash_plugin.repro compare "$WORK/det4k/run1" "$WORK/det4k/run2"
    rc=$?
    say "    dash-repro compare run1 run2 (exit $rc): $(tail -1 "$WORK/last.out")"
    run_step 60 "$PY" -m dash_plugin.repro plot "$WORK/det4k/run1" "$WORK/det4k/run2" -o "$OUT/repro_det_4k.png" \
      --title "${C_SIZE:-base}, seqlen ${C_SEQ:-4096}, deterministic: run1 vs run2 (GPUs ${C_DEVICES:-0,1})"
    verdict "c) plot repro_det_4k.png" $?
  fi

  run_step 120 "$PY" -m dash_plugin.repro run --parallel --devices "${C_DEVICES:-0,1}" --out "$WORK/atomic4k" "${C_ARGS[@]}" \
    --steps "${C_ATOMIC_STEPS:-20}" --schedule atomic
  rc=$?
  first=$(grep -E '^(IDENTICAL|DIFFERENT)' "$WORK/last.out" | tail -1)
  case $rc in
    1) say "PASS: c) atomic schedule, two runs diverge and the tool says where: $first [at $(elapsed) s]" ;;
    0) say "NOTE: c) atomic schedule, the two runs happened to agree (atomics may, not must, reorder): $first" ;;
    *) verdict "c) atomic schedule pair" $rc ;;
  esac
  if [[ -s "$WORK/atomic4k/run1/steps.jsonl" && -s "$WORK/atomic4k/run2/steps.jsonl" ]]; then
    run_step 60 "$PY" -m dash_plugin.repro plot "$WORK/atomic4k/run1" "$WORK/atomic4k/run2" \
      -o "$OUT/repro_atomic_4k.png" --title "${C_SIZE:-base}, seqlen ${C_SEQ:-4096}, atomic: run1 vs run2 (GPUs ${C_DEVICES:-0,1})"
    verdict "c) plot repro_atomic_4k.png" $?
  fi
fi

# ------------------------------------------------------------------------------------------ d) Trainer
if want d; then
  section "d) Hugging Face Trainer, two runs on the GPU"
  run_step 150 env CUDA_VISIBLE_DEVICES=0 "$PY" -m pytest -q -rA -s -p no:cacheprovider \
    tests/test_repro_trainer.py -k gpu
  rc=$?
  line=$(pytest_line)
  [[ $rc == 0 && "$line" == *skipped* ]] && rc=3
  verdict "d) Trainer (bf16, dash kernels) two runs identical: $line; $(grep -E '^(IDENTICAL|DIFFERENT)' "$WORK/last.out" | tail -1)" $rc
fi

# ------------------------------------------------------------------------------------------ e) speed
if want e; then
  section "e) end-to-end speed on GPU 0"
  run_step 240 env CUDA_VISIBLE_DEVICES=0 "$PY" scripts/gpu_e2e_speed.py "$OUT"
  verdict "e) scripts/gpu_e2e_speed.py -> e2e_speed.json / e2e_speed.md" $?
  grep -E "^seqlen .*(ms/step|unavailable|failed|oom|within 3%)" "$WORK/last.out" | sed 's/^/    /' >> "$SUM"
fi

if [[ -n "${SIDE_PID:-}" ]]; then
  section "waiting for the side job on GPU 1"
  wait "$SIDE_PID"
  cat "$WORK/side_gpu1.log" >> "$LOG"
  say "side job on GPU 1: $(tail -1 "$WORK/side_gpu1.log")"
fi

section "done"
say "total $(elapsed) s"
echo
cat "$SUM"
