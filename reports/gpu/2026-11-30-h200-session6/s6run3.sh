#!/usr/bin/env bash
# session 6 run 3 (nvidia-h200-x2), the final code: GPU 0: every gpu test of the tree and rlk check;
# GPU 1: attention benchmark (plain-launch rows side by side), per-kernel breakdown, host overhead
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention breakdown host_overhead" \
   BENCH_ATTENTION_TIMEOUT=200 BREAKDOWN_TIMEOUT=100 HOST_TIMEOUT=120 \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=400 TEST_CASE_TIMEOUT=380 \
  PERF_TIMEOUT=60 CHECK_TIMEOUT=50 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -v "^{" /tmp/b.log | cut -c1-200 | grep -E "step|Error|error|graph|best|us/call" | tail -80
