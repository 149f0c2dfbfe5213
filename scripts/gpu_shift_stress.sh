#!/usr/bin/env bash
# Does the causal symmetric shift stall? Re-runs the benchmark sequence that stalled once
# (hdim 128 causal S=512, B=32, H=16: auto, atomic, ascending, descending, then shift) in fresh
# processes, with no debug waits,
# until the time budget is spent. A stall shows as a cell marked 'hung' (exit status 3).
# Usage: OUT=dir bash scripts/gpu_shift_stress.sh [seconds, default 300]
OUT=${OUT:-/tmp/dash_shift_stress}; mkdir -p "$OUT"
BUDGET=${1:-300}; END=$((SECONDS + BUDGET)); i=0
export PYTHONUNBUFFERED=1
while (( SECONDS < END )); do
  i=$((i + 1))
  timeout 90 dash-bench --hdims 128 --masks causal --seqlens 512,1024 --warmup-ms 10 --rep-ms 50 \
      --cell-timeout 40 --impls dash-auto,dash-atomic,dash-ascending,dash-descending,dash-shift \
      --out "/tmp/shift_stress_$i" > "/tmp/shift_stress_$i.log" 2>&1
  rc=$?
  shift_cells=$(grep -c "dash-shift: fwd" "/tmp/shift_stress_$i.log")
  echo "run $i: exit $rc, shift cells finished $shift_cells/2, $(grep -h 'dash-shift: fwd' /tmp/shift_stress_$i.log | sed 's/.*bwd \([0-9.]*\) TFLOP.*/\1/' | tr '\n' ' ')" | tee -a "$OUT/shift_stress.txt"
  if (( rc != 0 )); then cp "/tmp/shift_stress_$i.log" "$OUT/failed_run_$i.log"; fi
done
echo "$i runs" | tee -a "$OUT/shift_stress.txt"
