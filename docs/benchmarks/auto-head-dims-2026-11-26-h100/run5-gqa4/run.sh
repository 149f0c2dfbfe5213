source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 570 python3 scripts/gpu_hopper_bwd.py --stages time --gqa 4 --hdims 64,128 --seqlens 1024,2048,4096,8192,16384 \
  --repeat 3 --no-triton --out $OUT > $OUT/orders.log 2>&1
echo "rc=$?"
grep "^time" $OUT/orders.log
