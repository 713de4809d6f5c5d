#!/usr/bin/env bash
# session 14 run 4 (nvidia-h200, .whl carried): the attention benchmark's prefill and training rows (rows
# .no_wg: the Triton kernel side by side), then the warpgroup probe: shipped hopper.CONFIGS against
# session 13's configuration (2 + 2 ring slots, no register cap) in the same process.
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" BENCH_ATTENTION_TIMEOUT=300 DEADLINE=330 \
  BENCH_ATTENTION_ARGS="--kinds prefill,train" bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -E "prefill|train|rc=|step|Error" | grep -v -E "~|@" | cut -c1-200 | tail -40
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/tc timeout 200 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages shipped,2x2x64 --repeats 21 2>&1 | grep -v "^  " | tail -30
