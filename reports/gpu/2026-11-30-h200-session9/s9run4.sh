#!/usr/bin/env bash
# session 9 run 4 (final; nvidia-h200-x2, .whl carried): TMA loads on by default for the train path, the value-slice
# rule back to "the doubled grid fits one wave" (at most 4 slices) after run 3's table-free rows. GPU 0: every gpu
# test of the tree and rlk check on CUDA; GPU 1: the attention benchmark.
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention" BENCH_ATTENTION_TIMEOUT=300 \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1; cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=420 TEST_CASE_TIMEOUT=400 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -E "^best|^== step|Error|error" /tmp/b.log | cut -c1-200 | tail -40
