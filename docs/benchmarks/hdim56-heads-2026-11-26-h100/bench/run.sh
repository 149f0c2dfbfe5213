source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 dash-bench --hdims 56 --seqlens 4096,8192,16384 --masks causal --max-minutes 6 \
  --impls dash-auto,dash-spt,dash-atomic,sdpa-cudnn --out $OUT/bench > $OUT/bench.log 2>&1
echo "rc=$?"
tail -30 $OUT/bench.log
