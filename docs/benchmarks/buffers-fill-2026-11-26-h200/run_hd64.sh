#!/usr/bin/env bash
source out/setup.sh
set -o pipefail
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore::DeprecationWarning -W ignore::UserWarning tests/test_buffers.py 2>&1 | tail -60 | tee $OUT/test_buffers.log
V=dash_det,dash_det_ourfill,dash_det_nofill,dash_atomic
timeout 300 python3 scripts/gpu_e2e_speed.py $OUT/hd64 --size 1b --rounds 3 --variants $V 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/hd64.log | tail -8
