#!/usr/bin/env bash
# session 24 run 2 (nvidia-h200, .whl carried): the attention shard of the GPU tests on this
# session's final tree (the transposed kernel's four-block step over a contiguous cache as one
# 256-row copy per key / value slot; the decode kernels' base row loaded beside the table row; the
# combine reading its table row before it waits for the split kernel).
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=565 TESTS_TIMEOUT=520 TEST_CASE_TIMEOUT=500 \
  PERF_TIMEOUT=30 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
