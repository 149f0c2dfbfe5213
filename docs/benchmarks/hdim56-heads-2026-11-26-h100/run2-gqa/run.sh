source out/setup.sh
set -o pipefail
mkdir -p $OUT
timeout 150 python3 scripts/gpu_hopper_bwd.py --stages time --hdims 56 --gqa 4 --seqlens 8192,16384 --masks causal \
  --orders spt,shift,descending --repeat 3 --no-triton --no-fa4 --out $OUT > $OUT/orders.log 2>&1
echo "rc=$?"
grep "^time" $OUT/orders.log
