#!/usr/bin/env bash
# session 12 run 1 (nvidia-h200-x2, .whl carried): the score pass for decode steps of few pairs
# (rlk_attn_qk, rlk_attn_fwd_split(SCORES=True)). GPU 0: the attention GPU tests that cover the decode
# paths and every config, the profiler names, rlk check on CUDA. GPU 1: decode at batch 1 / 4 / 16 with the
# .no_sp rows (the same step without the score pass) and every value slicing.
(export CUDA_VISIBLE_DEVICES=1
 OUT=$OUT/b WORK=/tmp/wb STEPS="bench_attention" BENCH_ATTENTION_TIMEOUT=300 \
   BENCH_ATTENTION_ARGS="--kinds decode --decode-batch 1,4,16" bash tools/benchmarking/gpu_all_run.sh > /tmp/b.log 2>&1
 cp /tmp/b.log $OUT/b/log.txt) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a WORK=/tmp/wa STEPS="tests check_cuda" XDIST=16 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py" TESTS_TIMEOUT=400 TEST_CASE_TIMEOUT=380 \
  KEXPR="score_pass or every_shipped or value_slices or paired_blocks or programmatic or profiler or decode_step_without or long_contexts or split_merge or accuracy_cached" \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=25 bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -40; wait
echo "=== GPU1 log"; grep -E "decode|^== step|Error|error" /tmp/b.log | grep -v "@v8" | cut -c1-160 | tail -70
