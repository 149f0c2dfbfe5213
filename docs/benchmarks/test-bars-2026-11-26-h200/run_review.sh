#!/usr/bin/env bash
source out/setup.sh
W="-W ignore::DeprecationWarning -W ignore::UserWarning"
timeout 470 python3 -m pytest -q -n 4 -p no:cacheprovider -rf --tb=short $W \
  tests/test_buffers.py \
  tests/test_gpu_kernels.py::test_every_feature_every_schedule_matches_float64_oracle \
  tests/test_gpu_kernels.py::test_int64_offsets_beyond_2_pow_31_elements \
  tests/test_gpu_kernels.py::test_schedules_agree_with_each_other \
  tests/test_hf_gpu.py \
  tests/test_gpu_hopper.py::test_forward_matches_oracle_and_repeats_its_bits \
  tests/test_gpu_hopper_varlen.py::test_packed_forward_matches_float64_oracle \
  tests/test_gpu_hopper_wide.py::test_forward_matches_float64_oracle \
  "tests/test_gpu_dropout.py::test_packed_batch_matches_float64_oracle_with_the_same_mask" \
  2>&1 | tail -40 | tee $OUT/gpu_tests.log
