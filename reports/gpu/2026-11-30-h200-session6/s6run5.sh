#!/usr/bin/env bash
# session 6 run 5 (nvidia-h200-x2): the tile-table kernel's one-load path for decode steps of at
# most 64 rows (tried: slower, reverted), launch_plainly(); GPU 0: attention-path gpu tests and rlk check; GPU 1: decode
# benchmark, breakdown, and the ablation tool refactored at the end of session 5 (shared block walk)
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention breakdown ablation" \
   BENCH_ATTENTION_ARGS="--kinds decode" BENCH_ATTENTION_TIMEOUT=120 BREAKDOWN_TIMEOUT=80 ABLATION_TIMEOUT=100 \
   ABLATION_ARGS="--shapes 32x512,4x4096 --only ind|cached|varlen" \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=15 TESTS_TIMEOUT=300 \
  TEST_CASE_TIMEOUT=280 PERF_TIMEOUT=40 CHECK_TIMEOUT=50 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py tests/backends/shared/triton/test_host_path_triton.py tests/ops/attention tests/entrypoints/test_check.py" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -30; wait
echo "=== GPU1 log"; grep -v "^{" /tmp/b.log | cut -c1-200 | grep -E "step|Error|error|graph|best|probe|rlk\.|sdpa" | tail -60
