#!/usr/bin/env bash
# session 15 run 3 (nvidia-h200, .whl carried): the persistent warpgroup forward taking work items from an atomic counter (3 programs per SM, the next
# item's first copies issued before a tile's stores); the probe (round-robin CUDA-graph timing) against run 1's
# kernel (s15_baseline_hopper.py = `git show 62479c7:<hopper.py>`, the baseline stage);
# the warpgroup, profiler-name and harness GPU tests; rlk check.
# The kernel measured: `git checkout 62479c7 && git apply reports/gpu/2026-12-01-h200-session15/run3_persistent_counter.patch`.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 240 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages shipped --baseline s15_baseline_hopper.py --repeats 21 2>&1 \
  | grep -v "^  " | grep -E "FAIL|OK|time|Error|error" | tail -40
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=320 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py tests/benchmarks/test_bench_harness.py" \
  KEXPR="warpgroup or profiler or cuda_graph" TESTS_TIMEOUT=150 \
  TEST_CASE_TIMEOUT=140 PERF_TIMEOUT=1 CHECK_TIMEOUT=25 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|best" | tail -20
