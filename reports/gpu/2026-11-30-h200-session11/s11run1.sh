#!/usr/bin/env bash
# session 11 run 1 (nvidia-h200-x2; .whl and .base carried — .base = `git archive 3104735 rl_engine benchmarks tools
# pyproject.toml`, the session-10 code): base-2 scores with the scale inside one multiply-add per score
# (rlk_attn_step, every forward and backward kernel) and the prefill / dq tiles taken longest first (LONGEST_FIRST).
# GPU 0: every gpu test of the tree and rlk check on CUDA.
# GPU 1: the attention benchmark on this code (with .table_order rows), the same benchmark on the session-10 code
# (side by side on one GPU, one after the other), and a GEMM sweep at the remaining misses.
cp -r .whl .base/ 2>/dev/null
(export CUDA_VISIBLE_DEVICES=1
 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention sweep" BENCH_ATTENTION_TIMEOUT=230 \
   SWEEP_ARGS="--skip-bits --shapes gate_up qkv --ms 4096 16384" SWEEP_TIMEOUT=75 \
   SWEEP2_ARGS="--skip-bits --shapes gate_up down --ms 1 64" SWEEP2_TIMEOUT=50 \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1
 cd .base && OUT=$OUT/base WORK=/tmp/wbase STEPS="bench_attention" BENCH_ATTENTION_TIMEOUT=175 \
   BENCH_ATTENTION_ARGS="--repeats 9" bash tools/benchmarking/gpu_all_run.sh > /tmp/base.log 2>&1
 cp /tmp/b.log $OUT/b/log.txt; cp /tmp/base.log $OUT/base/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=480 TEST_CASE_TIMEOUT=460 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -E "^best|^== step|Error|error|BEST" /tmp/b.log | cut -c1-200 | tail -40
echo "=== base log"; grep -E "^best|^== step|Error|error" /tmp/base.log | cut -c1-200 | tail -30
