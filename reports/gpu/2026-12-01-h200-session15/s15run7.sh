#!/usr/bin/env bash
# session 15 run 7 (nvidia-h200, .whl carried): run 6's code, the attention benchmark's prefill rows (round-robin).
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" DEADLINE=200 BENCH_ATTENTION_TIMEOUT=180 BENCH_ATTENTION_ARGS="--kinds prefill" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 | grep -E "best|took" | tail -10
