source out/setup.sh
POINTS=${POINTS:-64:full:8192,64:full:4096,64:causal:16384,96:causal:16384,160:full:8192,128:full:4096:4,56:causal:16384}
set -o pipefail
mkdir -p $OUT
export PYTHONPATH=$PYTHONPATH:$PWD
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 560 python3 scripts/gpu_sustained_orders.py --points ${POINTS} \
  --rounds 2 --seconds 4 --out $OUT > $OUT/sustained.log 2>&1
echo "rc=$?"
grep "^sustained\|Error\|error" $OUT/sustained.log | cut -c1-600
