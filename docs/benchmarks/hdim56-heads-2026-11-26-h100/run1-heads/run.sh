source out/setup.sh
set -o pipefail
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 540 python3 scripts/gpu_hopper_bwd.py --stages time --hdims 56,64 --seqlens 8192,16384 --masks causal \
  --heads 32,36,28,40 --orders spt,shift,descending,ascending --repeat 3 --no-triton --no-fa4 --out $OUT > $OUT/orders.log 2>&1
echo "rc=$?"
grep "^time" $OUT/orders.log
tail -3 $OUT/orders.log
