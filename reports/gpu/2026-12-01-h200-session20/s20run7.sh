#!/usr/bin/env bash
# session 20 run 7 (nvidia-h200, .whl carried): the final tree with the 5-stage M = 1, N <= 4096
# GEMM tile: the GEMM GPU tests (every shipped configuration raw-bit equal, dX / dW, profiler
# names), the GEMM benchmark twice, and `rlk check --device cuda` (whose decode steps at M = 1 run
# the new tile).
set -uo pipefail
START=$(date +%s)
OUT0=$OUT
OUT=$OUT0/t WORK=/tmp/wt STEPS="tests" XDIST=16 DEADLINE=200 TESTS_TIMEOUT=180 TEST_CASE_TIMEOUT=170 PERF_TIMEOUT=40 \
  TESTS="tests/backends/shared/triton/test_gemm_triton.py" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|step" | tail -20
for i in 1 2; do
  OUT=$OUT0/g$i WORK=/tmp/w$i STEPS="bench_gemm" DEADLINE=100 \
    bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -E "step|True|False" | awk -v i=$i '{print "bench" i ": " $0}'
  rm -f $OUT0/g$i/results.tgz $OUT0/g$i/run.log
done
echo "gemm done $(( $(date +%s) - START ))s"
OUT=$OUT0/c WORK=/tmp/wc STEPS="check_cuda" DEADLINE=$(( 480 - ($(date +%s) - START) )) CHECK_TIMEOUT=90 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-300 | grep -E "rc=|rlk check|step" | tail -20
