source out/setup.sh
set -o pipefail
mkdir -p $OUT/mha $OUT/gqa
timeout 280 python3 scripts/gpu_hopper_bwd.py --stages time --hdims 64 --masks causal --seqlens 8192,16384 --repeat 5 --no-triton --out $OUT/mha > $OUT/mha/orders.log 2>&1
timeout 280 python3 scripts/gpu_hopper_bwd.py --stages time --gqa 4 --hdims 64 --masks causal --seqlens 8192,16384 --repeat 5 --no-triton --out $OUT/gqa > $OUT/gqa/orders.log 2>&1
grep "^time" $OUT/*/orders.log
