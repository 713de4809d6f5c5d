#!/usr/bin/env bash
# session 26 run 4 (nvidia-h200, .whl carried): the tail split of persistent GEMM launches
# (configs.tail_split: a last wave at most half full runs as half-width tiles in a second launch).
# The GPU tests of every module whose path it changes (gemm.linear, the fused LM head, rlk check's
# GPU tests at Qwen3-0.6B's dimensions), then the GEMM benchmark of record in graph mode with the
# ablation rows (rlk.triton.tile_gemm.one_launch: the same tree without the split), the fused
# LM-head benchmark, and `rlk check --device cuda` fp32 / bf16 / the P/P control.
OUT=$OUT WORK=/tmp/w STEPS="tests bench_gemm bench_logprob check_cuda" XDIST=16 DEADLINE=560 \
  TESTS="tests/backends/shared/triton/test_gemm_triton.py tests/backends/shared/triton/test_linear_logprob_triton.py tests/entrypoints/test_check.py" \
  TESTS_TIMEOUT=300 TEST_CASE_TIMEOUT=280 PERF_TIMEOUT=60 BENCH_GEMM_TIMEOUT=120 BENCH_GEMM_ARGS="--modes graph --one-launch" \
  BENCH_LOGPROB_TIMEOUT=90 CHECK_TIMEOUT=40 CHECK_RUNS="--dtype float32;--dtype bfloat16;--dtype bfloat16 --plan P/P" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch|True|False|naive|rlk.fused " | tail -80
