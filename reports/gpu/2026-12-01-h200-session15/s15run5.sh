#!/usr/bin/env bash
# session 15 run 5 (nvidia-h200, .whl carried), the final code: the attention benchmark (prefill, train, decode;
# graph rows replayed round-robin).
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" DEADLINE=585 BENCH_ATTENTION_TIMEOUT=560 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 | tail -60
