#!/usr/bin/env bash
# session 17 run 2 (nvidia-h200, .whl carried): the decode benchmark rows run 1 did not reach (batch 1 and 64 at
# 32768 keys, batch 64 at 4096; default vs .two_launch side by side), then the split-merge GPU test (fixed: no host
# tensors built while capturing) and the paged-attention tests that replay CUDA graphs through the harness.
OUT=$OUT WORK=/tmp/w STEPS="bench_attention bench_attention_extra" DEADLINE=330 \
  BENCH_ATTENTION_TIMEOUT=170 BENCH_ATTENTION_ARGS="--kinds decode --decode-batch 1,64 --decode-ctx 32768" \
  BENCH_ATTENTION_EXTRA_TIMEOUT=120 BENCH_ATTENTION_EXTRA_ARGS="--kinds decode --decode-batch 64 --decode-ctx 4096" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 | grep -E "softmax |paged16 |two_launch|sdpa|step|rc=" | tail -30
mkdir -p $OUT/tests && OUT=$OUT/tests WORK=/tmp/w STEPS="tests" XDIST=8 DEADLINE=$(( 585 - SECONDS )) \
  TESTS="tests/backends/shared/triton/test_attention_triton.py tests/ops/attention/test_paged_attention.py" \
  KEXPR="split_merges or graph or capturable or tile_table or programmatic" TESTS_TIMEOUT=230 TEST_CASE_TIMEOUT=220 PERF_TIMEOUT=1 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert" | tail -30
