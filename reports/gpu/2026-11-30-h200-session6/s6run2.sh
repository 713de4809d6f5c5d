#!/usr/bin/env bash
# session 6 run 2 (nvidia-h200-x2): programmatic dependent launch (tile table -> attention kernel,
# split -> combine); narrow decode tiles removed. GPU 0: attention-path gpu tests and rlk check;
# GPU 1: per-kernel breakdown and the attention benchmark (with the plain-launch rows side by side)
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="breakdown bench_attention" BREAKDOWN_TIMEOUT=100 \
   BENCH_ATTENTION_TIMEOUT=200 bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=15 TESTS_TIMEOUT=330 \
  TEST_CASE_TIMEOUT=300 PERF_TIMEOUT=40 CHECK_TIMEOUT=60 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py tests/backends/shared/triton/test_host_path_triton.py tests/ops/attention tests/entrypoints/test_check.py" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -v "^{" /tmp/b.log | cut -c1-220 | grep -E "step|Error|error|graph|rlk_attn|best|p50" | tail -100
