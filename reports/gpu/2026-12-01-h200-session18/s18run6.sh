#!/usr/bin/env bash
# session 18 run 6 (nvidia-h200, .whl carried): `rlk check --kv-cache paged`. The long-context GPU tests of
# tests/entrypoints/test_check.py (contiguous and paged rollout caches at Qwen3-0.6B's dimensions, the P/P
# control), then `rlk check --device cuda` past the first KV split over a paged cache.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=4 DEADLINE=400 TESTS="tests/entrypoints/test_check.py" \
  KEXPR="long_context" TESTS_TIMEOUT=250 TEST_CASE_TIMEOUT=240 PERF_TIMEOUT=1 CHECK_TIMEOUT=110 \
  CHECK_RUNS="--dtype bfloat16 --preset qwen3-0.6b --extra-prompt-tokens 1000 --kv-cache paged" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
