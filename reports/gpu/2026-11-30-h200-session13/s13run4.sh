#!/usr/bin/env bash
# session 13 run 4 (final kernels; nvidia-h200, .whl carried): every gpu test of the tree with the Hopper
# warpgroup forward as the train path's default (bf16/fp16, D = 128), then rlk check on CUDA.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=560 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=460 TEST_CASE_TIMEOUT=430 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=20 bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40
