#!/usr/bin/env bash
# session 6 run 6 (nvidia-h200): the gpu tests whose graph capture now goes through
# benchmarks.common.harness.capture_cuda_graph (also behind cuda_graph_ms), the planted-module
# helper shared with the interpreter test, and a quick attention benchmark through cuda_graph_ms
OUT=$OUT/a WORK=/tmp/wa STEPS="tests bench_attention" XDIST=8 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py tests/ops/attention" \
  KEXPR="programmatic or profiler or paged or interior" TESTS_TIMEOUT=300 TEST_CASE_TIMEOUT=280 PERF_TIMEOUT=60 \
  BENCH_ATTENTION_ARGS="--quick --kinds decode" BENCH_ATTENTION_TIMEOUT=90 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|step|Error|best" | tail -30
