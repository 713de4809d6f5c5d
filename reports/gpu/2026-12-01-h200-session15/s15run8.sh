#!/usr/bin/env bash
# session 15 run 8 (nvidia-h200, .whl carried): the harness after cuda_graph_ms became cuda_graphs_interleaved_ms of
# one callable: its GPU tests, and the bounded-performance smoke tests that time through it.
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=4 DEADLINE=170 TESTS="tests/benchmarks tests/backends/shared/triton" \
  KEXPR="cuda_graph or bounded_performance" TESTS_TIMEOUT=120 TEST_CASE_TIMEOUT=110 PERF_TIMEOUT=60 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -20
