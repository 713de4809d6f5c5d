#!/usr/bin/env bash
# session 10 run 2 (nvidia-h200-x2, .whl carried): the rules after run 1 — pages pair blocks in the few-programs tile,
# contiguous few-programs steps pair where kernels.pair_blocks says so, one-split steps of many pairs take the 2-warp
# tile — with ~u1 / ~u2 rows beside the defaults; batch 4 / 64 at 4096 / 32768 keys with every decode candidate.
# GPU 0: every gpu test of the tree and rlk check on CUDA; GPU 1: the benchmarks.
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention bench_attention_extra" \
   BENCH_ATTENTION_TIMEOUT=240 BENCH_ATTENTION_ARGS="--unroll 1,2" BENCH_ATTENTION_EXTRA_TIMEOUT=240 \
   BENCH_ATTENTION_EXTRA_ARGS="--kinds decode --decode-batch 4,64 --decode-ctx 4096,32768 --configs all --repeats 9" \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1; cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=450 TEST_CASE_TIMEOUT=420 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -E "^best|^== step|Error|error" /tmp/b.log | cut -c1-200 | tail -60
