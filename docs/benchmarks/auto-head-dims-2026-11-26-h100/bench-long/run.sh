source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_hopper_head_dims.py -k "many_passes and (56 or 32) or auto" -rA 2>&1 | grep -v Warning | grep -E "PASS|FAIL|passed|failed|error" | tee $OUT/tests.txt
timeout 330 dash-bench --hdims 128,64 --seqlens 8192,16384 --max-minutes 5 \
  --impls dash-auto,dash-ascending,dash-atomic,fa4-det,sdpa-cudnn --out $OUT/bench > $OUT/bench.log 2>&1
echo "rc=$?"
grep -A12 "^## Backward" $OUT/bench/results.md
