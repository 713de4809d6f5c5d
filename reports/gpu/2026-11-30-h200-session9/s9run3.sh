#!/usr/bin/env bash
# session 9 run 3 (nvidia-h200-x2, .whl carried): the final kernels of the session (table-free steps and the
# value-slice rule for few pairs, the few-programs tile where it fits one wave, TMA loads for the train path
# behind kernels.tma_loads()). GPU 0: every gpu test of the tree and rlk check on CUDA; GPU 1: the attention
# benchmark (.tma and .no_v rows beside the defaults) and batch 4 / 16 at 4096 / 32768 keys with every
# decode candidate.
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention bench_attention_extra" \
   BENCH_ATTENTION_TIMEOUT=300 BENCH_ATTENTION_EXTRA_TIMEOUT=200 \
   BENCH_ATTENTION_EXTRA_ARGS="--kinds decode --decode-batch 4,16 --decode-ctx 4096,32768 --configs all --repeats 9" \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1; cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=510 TEST_CASE_TIMEOUT=480 \
  PERF_TIMEOUT=40 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -E "^best|^== step|Error|error" /tmp/b.log | cut -c1-200 | tail -60
