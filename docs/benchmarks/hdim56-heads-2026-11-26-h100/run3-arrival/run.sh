source out/setup.sh
set -o pipefail
mkdir -p $OUT
timeout 300 python3 scripts/gpu_hopper_bwd.py --stages time --hdims 56 --seqlens 4096,8192,16384 --masks causal \
  --heads 36,32 --orders arrival,spt,shift,descending --repeat 3 --no-triton --no-fa4 --out $OUT > $OUT/orders.log 2>&1
echo "rc=$?"
grep "^time" $OUT/orders.log
