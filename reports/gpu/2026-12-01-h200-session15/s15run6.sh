#!/usr/bin/env bash
# session 15 run 6 (nvidia-h200, .whl carried): the output rounded before its relayout when no fp32 rows are stored,
# and launches without merges at a 168-register cap (CONFIGS[False]); the probe (round-robin) against 160 for every
# launch and against run 4's kernel (s15_baseline_hopper.py = `git show 74ba65d:<hopper.py>`, the baseline stage);
# the warpgroup and profiler-name GPU tests; rlk check.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 240 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages shipped,1x2x64r160 --baseline s15_baseline_hopper.py --repeats 21 2>&1 \
  | grep -v "^  " | grep -E "FAIL|OK|time|Error|error" | tail -40
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=320 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py" KEXPR="warpgroup or profiler" TESTS_TIMEOUT=150 \
  TEST_CASE_TIMEOUT=140 PERF_TIMEOUT=1 CHECK_TIMEOUT=25 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|best" | tail -20
