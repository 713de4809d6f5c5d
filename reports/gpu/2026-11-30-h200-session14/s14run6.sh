#!/usr/bin/env bash
# session 14 run 6 (nvidia-h200, .whl carried): run 5's kernel with the scratch tile register-major (coalesced):
# the probe, the warpgroup and profiler-name GPU tests, rlk check, the attention benchmark's prefill/train rows.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 110 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages shipped,2x2x64 --repeats 15 2>&1 | grep -v "^  " | grep -E "FAIL|time" | tail -16
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda bench_attention" XDIST=16 DEADLINE=300 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py" KEXPR="warpgroup or profiler" TESTS_TIMEOUT=150 \
  TEST_CASE_TIMEOUT=140 PERF_TIMEOUT=1 CHECK_TIMEOUT=20 BENCH_ATTENTION_TIMEOUT=50 BENCH_ATTENTION_ARGS="--kinds prefill,train" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|best" | tail -20
