#!/usr/bin/env bash
# session 7 run 4 (nvidia-h200): after cached_attention became plan_cached_attention + the step (and the
# model plans each rollout step once for every layer): the gpu tests of tests/ops, models, runtime, entrypoints; rlk check on CUDA,
# host time of a 36-layer decode step (one cached_attention per layer vs a plan + a step per layer)
OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda host_overhead" XDIST=8 TESTS="tests/ops tests/models tests/runtime tests/entrypoints" \
  TESTS_TIMEOUT=100 TEST_CASE_TIMEOUT=90 PERF_TIMEOUT=25 CHECK_TIMEOUT=25 HOST_TIMEOUT=70 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|decode|us" | tail -60
