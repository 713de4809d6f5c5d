#!/usr/bin/env bash
# session 12 run 4 (nvidia-h200, .whl carried): TMA copies for the unmasked run of decode steps over a
# contiguous cache (kernels.decode_tma_eligible). The decode benchmark at batch 1 / 4 / 16 / 64 (.no_dtma rows
# beside the default), then the GPU tests of the decode paths and every config.
OUT=$OUT WORK=/tmp/w STEPS="bench_attention tests" BENCH_ATTENTION_TIMEOUT=280 \
  BENCH_ATTENTION_ARGS="--kinds decode --decode-batch 1,4,16,64" XDIST=16 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py" TESTS_TIMEOUT=230 TEST_CASE_TIMEOUT=220 \
  KEXPR="decode_tma or every_shipped or value_slices or paired_blocks or decode_step_without or long_contexts or accuracy_cached" \
  PERF_TIMEOUT=1 bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -E "^best|passed|failed|FAILED|ERROR|SKIPPED|step|Error" | cut -c1-200 | tail -60
