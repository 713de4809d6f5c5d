#!/usr/bin/env bash
# session 9 run 1 (nvidia-h200-x2, .whl carried): GPU 0: every gpu test of the tree (value-slice test
# included) and rlk check on CUDA; GPU 1: attention benchmark (@v / .auto_v / .tile_free rows), the extra
# decode shapes (batch 1, 4, 16 at 4096 keys, every candidate), the ablation's TMA prefill probes.
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention bench_attention_extra ablation" \
   BENCH_ATTENTION_TIMEOUT=220 BENCH_ATTENTION_EXTRA_TIMEOUT=180 ABLATION_TIMEOUT=120 \
   BENCH_ATTENTION_EXTRA_ARGS="--kinds decode --decode-batch 1,4,16 --decode-ctx 4096 --configs all --repeats 9" \
   ABLATION_ARGS="--only tma|textbook_bn64_w8_s3|all.shipped" \
   bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1; cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=510 TEST_CASE_TIMEOUT=480 \
  PERF_TIMEOUT=40 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -v "^{" /tmp/b.log | cut -c1-200 | grep -E "step|Error|error|graph|best|us/call|decode|prefill|tma" | tail -90
