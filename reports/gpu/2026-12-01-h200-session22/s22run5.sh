#!/usr/bin/env bash
# session 22 run 5 (nvidia-h200, .whl carried): the attention shard of the GPU tests on this
# session's final tree (the warpgroup paged decode split kernel and its band; every other attention
# test, whose paged steps in the band now take it).
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=560 TESTS_TIMEOUT=520 TEST_CASE_TIMEOUT=500 \
  PERF_TIMEOUT=40 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
