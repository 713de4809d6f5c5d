#!/usr/bin/env bash
# session 13 run 6 (nvidia-h200, .whl carried): the warpgroup forward storing its outputs from the
# accumulator's registers (no shared-memory round trip in the epilogue): bits and time (probe), then the
# attention benchmark's prefill and training rows.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/tc timeout 200 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages 2x2x64 --repeats 21 2>&1 | grep -v "^  " | tail -30
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" BENCH_ATTENTION_TIMEOUT=300 DEADLINE=330 \
  BENCH_ATTENTION_ARGS="--kinds prefill,train" bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -E "prefill|train|rc=|step|Error" | grep -v -E "~|@|best" | cut -c1-200 | tail -40
