#!/usr/bin/env bash
# session 10 run 3 (final; nvidia-h200-x2, .whl carried): the decode rules after runs 1-2 — kernels.pair_blocks for
# the few-programs tiles (contiguous and paged), the 2-warp tile for steps of many pairs (MANY_DECODE_CONFIGS) but
# paged steps of 2-4 splits, every decode-only step without the tile table; the losing decode candidates dropped.
# GPU 0: every gpu test of the tree and rlk check on CUDA; GPU 1: the attention benchmark (defaults) and batch 4 / 16
# at 4096 / 32768 keys with ~u1 / ~u2 rows.
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention bench_attention_extra" \
   BENCH_ATTENTION_TIMEOUT=200 BENCH_ATTENTION_EXTRA_TIMEOUT=150 \
   BENCH_ATTENTION_EXTRA_ARGS="--kinds decode --decode-batch 4,16 --decode-ctx 4096,32768 --unroll 1,2 --repeats 9" \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1; cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=480 TEST_CASE_TIMEOUT=460 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -E "^best|^== step|Error|error" /tmp/b.log | cut -c1-200 | tail -60
