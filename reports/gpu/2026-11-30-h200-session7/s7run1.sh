#!/usr/bin/env bash
# session 7 run 1 (nvidia-h200-x2): GPU 0: every gpu test of the tree and rlk check;
# GPU 1: attention benchmark (decode_only rows and .tile_table rows side by side), per-kernel breakdown
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention breakdown" \
   BENCH_ATTENTION_TIMEOUT=240 BREAKDOWN_TIMEOUT=150 \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=420 TEST_CASE_TIMEOUT=400 \
  PERF_TIMEOUT=60 CHECK_TIMEOUT=40 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -v "^{" /tmp/b.log | cut -c1-200 | grep -E "step|Error|error|graph|best|us/call|decode|prefill" | tail -90
