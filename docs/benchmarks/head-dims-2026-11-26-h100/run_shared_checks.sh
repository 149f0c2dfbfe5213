source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 560 python3 -m pytest -v -rP -n 8 -p no:cacheprovider tests/test_gpu_hopper_head_dims.py tests/test_gpu_hopper_wide.py \
  -k "head_dims or wide" > $OUT/tests.log 2>&1
echo "rc=$?"
grep -E "passed|failed|error" $OUT/tests.log | tail -2
grep -E "FAILED|ERROR" $OUT/tests.log | head -40
grep "hopper load\]" $OUT/tests.log | sort | uniq
