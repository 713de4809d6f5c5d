#!/usr/bin/env bash
# session 11 run 3 (final; nvidia-h200-x2, .whl carried): base-2 scores (rlk_attn_step), the 3-stage prefill tile
# for 16-bit D = 128, the 2-warp decode tile for every step of many pairs (paged 2-4 splits included).
# GPU 0: every gpu test of the tree and rlk check on CUDA. GPU 1: the attention, GEMM and LM-head benchmarks.
(export CUDA_VISIBLE_DEVICES=1
 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention bench_gemm bench_logprob" BENCH_ATTENTION_TIMEOUT=250 \
   BENCH_GEMM_TIMEOUT=45 BENCH_LOGPROB_TIMEOUT=80 bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1
 cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=440 TEST_CASE_TIMEOUT=420 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -E "^best|^== step|Error|error" /tmp/b.log | cut -c1-200 | tail -40
