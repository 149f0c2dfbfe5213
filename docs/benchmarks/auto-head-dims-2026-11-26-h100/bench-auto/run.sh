source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt 2>/dev/null
timeout 500 dash-bench --hdims 64,40 --seqlens 1024,2048,4096,8192,16384 --max-minutes 7.5 \
  --impls dash-auto,dash-ascending,dash-atomic,fa4-det,sdpa-cudnn --out $OUT/bench > $OUT/bench.log 2>&1
echo "rc=$?"
tail -45 $OUT/bench.log
