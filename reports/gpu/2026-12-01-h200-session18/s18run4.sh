#!/usr/bin/env bash
# session 18 run 4 (nvidia-h200, .whl carried): `rlk check` past the first KV split. The GPU tests of
# tests/entrypoints/test_check.py (the new long-context test at Qwen3-0.6B's dimensions with its P/P control,
# the default's two dtypes and its control), then the check_cuda step (four `rlk check --device cuda` runs,
# the last `--preset qwen3-0.6b --extra-prompt-tokens 1000`).
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=4 DEADLINE=585 TESTS="tests/entrypoints/test_check.py" \
  TESTS_TIMEOUT=330 TEST_CASE_TIMEOUT=320 PERF_TIMEOUT=1 CHECK_TIMEOUT=120 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
