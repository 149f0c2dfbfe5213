source out/setup.sh
set -o pipefail
mkdir -p $OUT/p0 $OUT/p1
T="128=192x64,192x80,192x96,192x64-noRS,192x96-noRS"
timeout 280 python3 scripts/gpu_fwd_tiles.py $OUT/p1 --rounds 3 --dropout 0.1 --points 128:causal:2048,128:causal:8192,128:full:4096 --tiles "$T" 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/p1/run.log | tail -12
timeout 250 python3 scripts/gpu_fwd_tiles.py $OUT/p0 --rounds 3 --points 128:causal:2048,128:full:1024,128:full:4096 --tiles "$T" 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/p0/run.log | tail -12
