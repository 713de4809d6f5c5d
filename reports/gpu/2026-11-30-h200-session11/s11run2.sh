#!/usr/bin/env bash
# session 11 run 2 (final; nvidia-h200-x2, .whl carried): base-2 scores (rlk_attn_step) without run 1's longest-first
# tile order (measured slower, removed).
# GPU 0: every gpu test of the tree, rlk check on CUDA, the LM-head and GEMM benchmarks.
# GPU 1: the attention benchmark (defaults); every candidate config for prefill and batch-64 decode at 4096 keys;
# a GEMM sweep of the table's M > 1024 tile against the 3-stage, non-subtiled one on every shape.
(export CUDA_VISIBLE_DEVICES=1
 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention bench_attention_configs sweep" BENCH_ATTENTION_TIMEOUT=200 \
   BENCH_ATTENTION_CONFIGS_ARGS="--kinds prefill,decode --decode-batch 64 --decode-ctx 4096 --repeats 9" \
   BENCH_ATTENTION_CONFIGS_TIMEOUT=130 \
   SWEEP_ARGS="--skip-bits --ms 1024 4096 16384 --with-shipped --only 128x256x64_w8_s3_g16_tma_persistent_warp_specialize" \
   SWEEP_TIMEOUT=170 bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1
 cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda bench_logprob bench_gemm" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=480 TEST_CASE_TIMEOUT=460 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=25 BENCH_LOGPROB_TIMEOUT=80 BENCH_GEMM_TIMEOUT=60 bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|ratio|x[01]\.[0-9]" | tail -60; wait
rm -f $OUT/a/bench_*.json $OUT/b/bench_*.json  # at most 8 files come back; every JSON is in results.tgz too
echo "=== GPU1 log"; grep -E "^best|^== step|Error|error|BEST" /tmp/b.log | cut -c1-200 | tail -60
