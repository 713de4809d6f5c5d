#!/usr/bin/env bash
# session 25 run 1 (nvidia-h200, .whl carried): the attention shard of the GPU tests with session 24's
# paged loader patch applied (the transposed kernel's four-block step over pages, its page copies
# issued by a one-warp loader partition; the paged band (0, 4) programs/SM).
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=565 TESTS_TIMEOUT=520 TEST_CASE_TIMEOUT=500 \
  PERF_TIMEOUT=30 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
