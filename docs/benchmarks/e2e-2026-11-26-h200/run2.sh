source out/setup.sh
set -o pipefail
V=dash_det,dash_det_nofill,dash_det_noflag,dash_atomic
timeout 200 python3 scripts/gpu_e2e_speed.py $OUT/hd128 --size 1b-hd128 --variants $V 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/hd128.log | tail -12
timeout 200 python3 scripts/gpu_e2e_speed.py $OUT/hd64 --size 1b --variants $V 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/hd64.log | tail -12
