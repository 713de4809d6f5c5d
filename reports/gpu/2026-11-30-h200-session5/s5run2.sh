#!/usr/bin/env bash
# session 5 run 2 (nvidia-h200-x2): every gpu test on GPU 0; GPU 1: breakdown, attention bench, ablation over shapes, LM-head bench, rlk check
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="breakdown bench_attention ablation bench_logprob check_cuda" \
   ABLATION_ARGS="--shapes 128x128,32x512,8x1024,4x4096 --only ind|cached|varlen|all_m64" CHECK_TIMEOUT=60 \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS=tests XDIST=16 TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" \
  TESTS_TIMEOUT=430 TEST_CASE_TIMEOUT=400 PERF_TIMEOUT=60 bash tools/benchmarking/gpu_all_run.sh; wait
echo "=== GPU1 log"; cat /tmp/b.log | cut -c1-250 | tail -120
