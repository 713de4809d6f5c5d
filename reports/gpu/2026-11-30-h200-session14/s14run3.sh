#!/usr/bin/env bash
# session 14 run 3 (nvidia-h200, .whl carried): every gpu test of the tree with hopper.CONFIGS (launches
# without KV-split merges: 1 key + 2 value ring slots, 160 registers, three programs per SM), then rlk check.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=570 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=470 TEST_CASE_TIMEOUT=440 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=20 bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40
