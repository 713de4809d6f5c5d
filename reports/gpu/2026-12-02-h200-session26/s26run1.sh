#!/usr/bin/env bash
# session 26 run 1 (nvidia-h200, .whl carried): HEAD aeb66b8 (session 25's final tree: the host caches), not yet run through this shard. Every other GPU test, the attention
# benchmark of record (prefill; decode batch 1 / 4 / 16 / 64 at 512 / 4096 / 32768 keys, contiguous
# and 16-token pages, beside them the Triton kernels (.paged16.no_wg) and the steps without the
# transposed kernel (.no_wgt)), `rlk check --device cuda` fp32, bf16 and the P/P control, then the
# GEMM and linear_token_logprobs benchmarks of record (not re-timed since session 20).
OUT=$OUT WORK=/tmp/w STEPS="tests bench_attention check_cuda bench_logprob bench_gemm" XDIST=16 DEADLINE=580 \
  TESTS_TIMEOUT=300 TEST_CASE_TIMEOUT=280 PERF_TIMEOUT=60 SHARD=rest BENCH_ATTENTION_TIMEOUT=120 CHECK_TIMEOUT=40 \
  BENCH_LOGPROB_TIMEOUT=90 BENCH_GEMM_TIMEOUT=150 \
  CHECK_RUNS="--dtype float32;--dtype bfloat16;--dtype bfloat16 --plan P/P" \
  BENCH_ATTENTION_ARGS="--kinds prefill,decode --decode-batch 1,4,16,64 --decode-ctx 512,4096,32768 --repeats 9 --rows rlk.triton.blocked_online_softmax,*.paged16,*.paged16.no_wg,*.no_wgt,*.train_forward" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch|softmax|sdpa|rlk check|ratio|cublas|naive|liger" | tail -120
