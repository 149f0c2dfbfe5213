source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt 2>/dev/null
timeout 380 python3 -m pytest -q -n 8 -p no:cacheprovider -rf tests/test_hf_gpu.py \
  tests/test_gpu_hopper.py tests/test_gpu_hopper_head_dims.py \
  -k "auto or 56" > $OUT/tests.log 2>&1
echo "rc=$?"
grep -E "passed|failed|error" $OUT/tests.log | tail -2
grep -E "FAILED|ERROR" $OUT/tests.log | head -30
timeout 120 dash-bench --hdims 56,64 --seqlens 8192 --masks causal --impls dash-auto,dash-spt --out $OUT/bench > $OUT/bench1.log 2>&1
timeout 60 dash-bench --hdims 0 --out $OUT/bench > $OUT/bench2.log 2>&1; echo "bad hdims rc=$?"; tail -1 $OUT/bench2.log
timeout 100 dash-bench --hdims 56 --seqlens 8192 --masks causal --impls dash-auto --out $OUT/bench > $OUT/bench3.log 2>&1; echo "rc=$?"
grep -h "replacing\|dash-auto:" $OUT/bench1.log $OUT/bench3.log
