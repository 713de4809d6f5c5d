#!/usr/bin/env bash
# session 6 run 4 (nvidia-h200): the programmatic-dependent-launch test after its negative control
# was made to keep its outputs alive (run 3: a freed output's memory came back holding the right rows)
OUT=$OUT/a WORK=/tmp/wa STEPS="tests" XDIST=2 TESTS="tests/backends/shared/triton/test_attention_triton.py" \
  KEXPR="programmatic or profiler" TESTS_TIMEOUT=300 TEST_CASE_TIMEOUT=280 PERF_TIMEOUT=60 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|step|Error" | tail -20
