#!/usr/bin/env bash
# session 12 run 5 (final; nvidia-h200, .whl carried): every gpu test of the tree on the final code (TMA copies
# for the unmasked run of contiguous decode steps, not on the DECODE_CONFIGS tile), then rlk check on CUDA.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=540 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=460 TEST_CASE_TIMEOUT=430 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=20 bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40
