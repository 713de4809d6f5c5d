#!/usr/bin/env bash
# session 18 run 5 (nvidia-h200, .whl carried): as run 4 after the check's train layouts moved to the caller's NaN
# policy (default "raise"; the rollout keeps "propagate"): the GPU tests of tests/entrypoints/test_check.py (the
# long-context test now also asserts the train path's warpgroup forward ran), then the check_cuda step.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=4 DEADLINE=585 \
  TESTS="tests/entrypoints/test_check.py" \
  TESTS_TIMEOUT=330 TEST_CASE_TIMEOUT=320 PERF_TIMEOUT=1 CHECK_TIMEOUT=120 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
