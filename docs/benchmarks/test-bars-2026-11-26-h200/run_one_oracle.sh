#!/usr/bin/env bash
source out/setup.sh
timeout 440 python3 -m pytest -v -n 8 -p no:cacheprovider -rf --tb=short -W ignore::DeprecationWarning -W ignore::UserWarning tests/test_gpu_hopper.py::test_matches_float64_oracle tests/test_gpu_hopper.py::test_windows_and_softcap_match_float64_oracle tests/test_gpu_hopper.py::test_forward_matches_oracle_and_repeats_its_bits tests/test_gpu_dropout.py::test_matches_float64_oracle_with_the_same_mask tests/test_gpu_hopper_wide.py::test_forward_matches_float64_oracle tests/test_gpu_hopper_wide.py::test_backward_matches_float64_oracle tests/test_gpu_hopper_wide.py::test_windows_and_softcap_match_float64_oracle tests/test_gpu_hopper_wide.py::test_hdim256_arrival_reads_its_tables_and_matches_the_oracle tests/test_gpu_hopper_wide.py::test_dropout_matches_float64_oracle_with_the_same_mask > $OUT/gpu_tests_oracle.log 2>&1
echo rc=$?
grep -c PASSED $OUT/gpu_tests_oracle.log; grep -c FAILED $OUT/gpu_tests_oracle.log; tail -5 $OUT/gpu_tests_oracle.log
