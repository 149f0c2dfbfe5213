source out/setup.sh
set -o pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 400 dash-bench --dropout 0.1 --hdims 128,64 --seqlens 2048,4096,8192 --impls dash-auto,sdpa-flash --max-minutes 5.5 --out $OUT/drop 2>&1 | grep -v "Warning\|exe_args" | tail -25
