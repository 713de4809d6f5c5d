#!/usr/bin/env bash
# session 12 run 6 (nvidia-h200, .whl carried; the final kernels): prefill and training against SDPA, to check
# that the train-path launch (TMA_EDGE, the value copy's column offset) did not move.
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" BENCH_ATTENTION_TIMEOUT=190 DEADLINE=215 \
  BENCH_ATTENTION_ARGS="--kinds prefill,train" bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -E "^best|step|Error" | cut -c1-200 | tail -20
