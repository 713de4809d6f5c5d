#!/usr/bin/env bash
# session 18 run 2 (nvidia-h200, .whl carried): every other GPU test (SHARD=rest) on the tree of 597434f.
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=585 TESTS_TIMEOUT=480 TEST_CASE_TIMEOUT=460 \
  PERF_TIMEOUT=90 SHARD=rest \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert" | tail -30
