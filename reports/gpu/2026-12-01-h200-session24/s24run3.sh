#!/usr/bin/env bash
# session 24 run 3 (nvidia-h200, .whl carried): the final tree. The rest of the GPU tests, the
# attention benchmark of record (prefill; decode batch 1 / 4 / 16 / 64 at 512 / 4096 / 32768 keys,
# contiguous and 16-token pages; beside them the Triton kernels (.paged16.no_wg) and the steps
# without the transposed kernel (.no_wgt)), then `rlk check --device cuda` fp32, bf16 and the P/P
# control (the Qwen3-0.6B-shaped checks past the first KV split, contiguous and paged, run as GPU
# tests of the rest shard).
OUT=$OUT WORK=/tmp/w STEPS="tests bench_attention check_cuda" XDIST=16 DEADLINE=565 TESTS_TIMEOUT=300 \
  TEST_CASE_TIMEOUT=280 PERF_TIMEOUT=60 SHARD=rest BENCH_ATTENTION_TIMEOUT=120 CHECK_TIMEOUT=40 \
  CHECK_RUNS="--dtype float32;--dtype bfloat16;--dtype bfloat16 --plan P/P" \
  BENCH_ATTENTION_ARGS="--kinds prefill,decode --decode-batch 1,4,16,64 --decode-ctx 512,4096,32768 --repeats 9 --rows rlk.triton.blocked_online_softmax,*.paged16,*.paged16.no_wg,*.no_wgt,*.train_forward" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch|softmax|sdpa|rlk check" | tail -80
