#!/usr/bin/env bash
# session 20 run 3 (nvidia-h200, .whl carried): the rest of the GPU tests on this session's final
# tree, then the attention benchmark of record (prefill; decode batch 1 / 64 at 512 / 4096 / 32768
# keys, contiguous and 16-token pages).
OUT=$OUT WORK=/tmp/w STEPS="tests bench_attention" XDIST=16 DEADLINE=585 TESTS_TIMEOUT=330 TEST_CASE_TIMEOUT=320 \
  PERF_TIMEOUT=60 SHARD=rest BENCH_ATTENTION_TIMEOUT=400 \
  BENCH_ATTENTION_ARGS="--kinds prefill,decode --decode-batch 1,64 --decode-ctx 512,4096,32768 --repeats 9 --rows rlk.triton.blocked_online_softmax,*.paged16,*.train_forward" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch|softmax|sdpa" | tail -60
