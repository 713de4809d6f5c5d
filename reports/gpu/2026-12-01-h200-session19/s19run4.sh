#!/usr/bin/env bash
# session 19 run 4 (nvidia-h200, .whl carried): the attention shard of the GPU tests on this
# session's final kernels (warpgroup forward under PDL without the page-rows cast, the combine's
# group size, the split kernel's grid order), then the bounded-performance smoke.
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=585 TESTS_TIMEOUT=520 TEST_CASE_TIMEOUT=500 \
  PERF_TIMEOUT=50 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
