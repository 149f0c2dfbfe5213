source out/setup.sh
set -o pipefail
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
mkdir -p $OUT/p0 $OUT/p1
timeout 280 python3 scripts/gpu_fwd_tiles.py $OUT/p0 --rounds 3 --points 64:causal:1024,64:causal:2048,64:full:1024,128:full:1024,128:full:2048,128:causal:2048,128:full:4096 --tiles "64=128x128,192x96,192x192;128=128x96,128x160" 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/p0/run.log | tail -12
timeout 250 python3 scripts/gpu_fwd_tiles.py $OUT/p1 --rounds 3 --dropout 0.1 --points 128:causal:2048,128:causal:8192,128:full:4096,64:causal:4096 --tiles "64=128x128,192x96;128=128x96,128x80,128x112" 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/p1/run.log | tail -12
