#!/usr/bin/env bash
source out/setup.sh
set -o pipefail
timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_buffers.py 2>&1 | grep -v "Warning\|OperandMajorMode\|SmemAllocator\|^$" | tail -8 | tee $OUT/test_buffers.log
V=dash_det,dash_det_ourfill,dash_det_nofill,dash_atomic
timeout 420 python3 scripts/gpu_e2e_speed.py $OUT/hd128 --size 1b-hd128 --rounds 3 --variants $V 2>&1 | grep -v "Warning\|exe_args" | tee $OUT/hd128.log | tail -14
