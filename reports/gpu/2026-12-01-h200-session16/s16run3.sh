#!/usr/bin/env bash
# session 16 run 3 (nvidia-h200, .whl carried), the final code (quad_blocks + quad_tile): every GPU test of the
# tree (then the bounded-performance smoke alone) and rlk check.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=585 \
  TESTS_TIMEOUT=470 TEST_CASE_TIMEOUT=450 PERF_TIMEOUT=50 CHECK_TIMEOUT=40 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|best" | tail -30
