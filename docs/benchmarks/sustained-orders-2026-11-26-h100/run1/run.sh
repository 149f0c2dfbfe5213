source out/setup.sh
set -o pipefail
mkdir -p $OUT
export PYTHONPATH=$PYTHONPATH:$PWD
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 560 python3 scripts/gpu_sustained_orders.py --points 128:full:4096,128:full:16384,176:full:16384,128:causal:16384,128:full:8192 \
  --rounds 2 --seconds 4 --out $OUT > $OUT/sustained.log 2>&1
echo "rc=$?"
grep "^sustained\|Error\|error" $OUT/sustained.log | cut -c1-600
