source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 570 dash-bench --hdims 80,40,160 --seqlens 1024,4096,16384 --max-minutes 8.5 \
  --impls dash-auto,dash-atomic,dash-triton-auto,fa4,fa4-det,sdpa-cudnn --out $OUT/bench > $OUT/bench.log 2>&1
echo "rc=$?"
tail -60 $OUT/bench.log
