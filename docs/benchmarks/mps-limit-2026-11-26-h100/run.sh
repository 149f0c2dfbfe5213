source out/setup.sh
set -o pipefail
mkdir -p $OUT
timeout 200 python3 out/s30_mps.py > $OUT/mps.log 2>&1; echo "mps rc=$?"; grep -v Warning $OUT/mps.log | tail -4
timeout 300 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_compile.py tests/test_mps_limit.py > $OUT/tests.log 2>&1
echo "rc=$?"
grep -E "passed|failed|error" $OUT/tests.log | tail -2
grep -E "FAILED|ERROR" $OUT/tests.log | head -20
