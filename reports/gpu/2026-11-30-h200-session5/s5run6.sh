#!/usr/bin/env bash
# session 5 run 6 (nvidia-h200): the final code (decode/prefill selection): attention-path gpu tests, rlk check, benchmarks
OUT=$OUT/b WORK=/tmp/wb STEPS="tests check_cuda bench_attention breakdown bench_logprob ablation" XDIST=15 TESTS_TIMEOUT=230 \
  TEST_CASE_TIMEOUT=220 PERF_TIMEOUT=40 CHECK_TIMEOUT=60 ABLATION_TIMEOUT=70 \
  ABLATION_ARGS="--shapes 32x512,4x4096 --only ind|cached|varlen" \
  TESTS="tests/backends/shared/triton/test_attention_triton.py tests/backends/shared/triton/test_host_path_triton.py tests/ops/attention tests/entrypoints/test_check.py" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|best|step|prefill|decode B|T=8192|Error" | tail -70
