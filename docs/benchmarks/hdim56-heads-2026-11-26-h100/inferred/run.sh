source out/setup.sh
set -o pipefail
mkdir -p $OUT/a $OUT/b
timeout 380 python3 scripts/gpu_hopper_bwd.py --stages time --hdims 88,120,176 --seqlens 2048,16384 \
  --repeat 3 --no-triton --no-fa4 --out $OUT/a > $OUT/a/orders.log 2>&1
echo "rc=$?"
timeout 150 python3 scripts/gpu_hopper_bwd.py --stages time --hdims 224 --seqlens 2048,8192 \
  --repeat 2 --no-triton --no-fa4 --out $OUT/b > $OUT/b/orders.log 2>&1
echo "rc=$?"
grep -h "^time" $OUT/*/orders.log
