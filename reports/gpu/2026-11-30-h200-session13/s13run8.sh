#!/usr/bin/env bash
# session 13 run 8 (nvidia-h200, .whl carried): the warpgroup forward with block j + 1's score product issued
# before P's conversion and the rescale, and split merges after the P·V retires: the probe (bits, time), the
# attention GPU tests of the train path, the warpgroup kernel and parity, then rlk check on CUDA.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 120 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages 2x2x64 --repeats 15 2>&1 | grep -v "^  " | tail -20
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=330 \
  TESTS="tests/backends/shared/triton/test_attention_triton.py" TESTS_TIMEOUT=230 TEST_CASE_TIMEOUT=220 \
  KEXPR="warpgroup or long_contexts or prefill_decode or every_shipped or tma_loads or accuracy_forward or packing or run_to_run or negative or split_merge or unmasked_interior or profiler or dispatch" \
  PERF_TIMEOUT=1 CHECK_TIMEOUT=20 bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -v '^ ' | cut -c1-200 | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -30
