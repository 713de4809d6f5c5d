#!/usr/bin/env bash
# session 14 run 5 (nvidia-h200, .whl carried): the warpgroup forward walking each KV split on its own
# (merges between walks, thread-major scratch) at 1 key + 2 value slots and 160 registers for every
# launch: every gpu test of the tree, rlk check, the attention benchmark's prefill/training rows, the probe.
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda bench_attention" XDIST=16 DEADLINE=480 \
  TESTS="tests --ignore=tests/integrations/engines/rollout/vllm" TESTS_TIMEOUT=400 TEST_CASE_TIMEOUT=380 \
  PERF_TIMEOUT=30 CHECK_TIMEOUT=20 BENCH_ATTENTION_TIMEOUT=60 BENCH_ATTENTION_ARGS="--kinds prefill,train" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|throughput" | grep -v -E "~|@" | tail -40
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 100 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages shipped,2x2x64 --repeats 15 2>&1 | grep -v "^  " | tail -24
