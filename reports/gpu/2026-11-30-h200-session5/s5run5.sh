#!/usr/bin/env bash
# session 5 run 5 (nvidia-h200-x2): every gpu test on GPU 0 (ftz exp, constexpr G / page size, row reciprocal, chained dx);
# GPU 1: ablation with the table probes, launch-configuration sweep, breakdown, GEMM benchmark
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="ablation bench_attention_configs breakdown bench_gemm" \
   ABLATION_ARGS="--shapes 128x128,32x512,8x1024,4x4096 --only ind|cached|varlen" ABLATION_TIMEOUT=120 \
   BENCH_ATTENTION_CONFIGS_ARGS="--kinds prefill,decode" BENCH_ATTENTION_CONFIGS_TIMEOUT=200 BENCH_GEMM_TIMEOUT=200 \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS=tests XDIST=16 TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" \
  TESTS_TIMEOUT=430 TEST_CASE_TIMEOUT=400 PERF_TIMEOUT=60 bash tools/benchmarking/gpu_all_run.sh; wait
echo "=== GPU1 log"; grep -v "^{" /tmp/b.log | cut -c1-200 | grep -E "best|step|Error|error|prefill|decode B|rlk_attn|probe|cached|varlen|sdpa|ratio" | tail -90
