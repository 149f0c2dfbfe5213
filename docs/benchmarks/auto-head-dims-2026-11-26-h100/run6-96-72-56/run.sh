source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 560 python3 scripts/gpu_hopper_bwd.py --stages time --hdims 96,72,56 --seqlens 1024,4096,16384 \
  --repeat 3 --no-triton --out $OUT > $OUT/orders.log 2>&1
echo "rc=$?"
grep "^time" $OUT/orders.log
tail -5 $OUT/orders.log
