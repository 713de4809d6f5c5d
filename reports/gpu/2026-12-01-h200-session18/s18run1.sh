#!/usr/bin/env bash
# session 18 run 1 (nvidia-h200, .whl carried): the attention shard of the GPU tests on the tree of 597434f,
# then `rlk check --device cuda`.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=585 TESTS_TIMEOUT=470 TEST_CASE_TIMEOUT=450 \
  PERF_TIMEOUT=50 CHECK_TIMEOUT=40 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
