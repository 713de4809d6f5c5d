#!/usr/bin/env bash
# session 5 run 3 (nvidia-h200): every candidate launch configuration of prefill and decode after the prologue/epilogue changes;
# the gemm + linear-logprob test modules (the chained dx fix)
OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention_configs tests" BENCH_ATTENTION_CONFIGS_TIMEOUT=300 \
  BENCH_ATTENTION_CONFIGS_ARGS="--kinds prefill,decode" XDIST=15 TESTS_TIMEOUT=200 TEST_CASE_TIMEOUT=190 PERF_TIMEOUT=60 \
  TESTS="tests/backends/shared/triton/test_gemm_triton.py tests/backends/shared/triton/test_linear_logprob_triton.py" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | cut -c1-220 | tail -60
