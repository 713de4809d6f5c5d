#!/usr/bin/env bash
# session 17 run 1 (nvidia-h200, .whl carried): decode splits merged in the split kernel (split_merges) and the
# four-block step with its running maxima in order: the GPU tests that compare them raw-bit (split merges, paired
# blocks, value slices, decode TMA, PDL, profiler names), then the decode benchmark (.two_launch / .no_quad rows).
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=330 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py" \
  KEXPR="split_merges or paired or value_slices or decode_tma or programmatic or profiler_kernel_names" \
  TESTS_TIMEOUT=300 TEST_CASE_TIMEOUT=290 PERF_TIMEOUT=1 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert" | tail -30
mkdir -p $OUT/bench && OUT=$OUT/bench WORK=/tmp/w STEPS="bench_attention" DEADLINE=$(( 585 - SECONDS )) \
  BENCH_ATTENTION_TIMEOUT=250 BENCH_ATTENTION_ARGS="--kinds decode" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 | tail -30
