#!/usr/bin/env bash
# session 21 run 5 (nvidia-h200, .whl carried): the rest of the GPU tests on this session's final
# tree, the attention benchmark of record (prefill; decode batch 1 / 4 / 16 / 64 at 512 / 4096 /
# 32768 keys, contiguous and 16-token pages), then `rlk check --device cuda` (fp32 and bf16 R/R, the
# P/P control, bf16 past the first KV split at Qwen3-0.6B's dimensions, contiguous and paged).
OUT=$OUT WORK=/tmp/w STEPS="tests bench_attention check_cuda" XDIST=16 DEADLINE=590 TESTS_TIMEOUT=320 \
  TEST_CASE_TIMEOUT=310 PERF_TIMEOUT=60 SHARD=rest BENCH_ATTENTION_TIMEOUT=120 CHECK_TIMEOUT=90 \
  BENCH_ATTENTION_ARGS="--kinds prefill,decode --decode-batch 1,4,16,64 --decode-ctx 512,4096,32768 --repeats 9 --rows rlk.triton.blocked_online_softmax,*.paged16,*.train_forward" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch|softmax|sdpa|rlk check" | tail -80
