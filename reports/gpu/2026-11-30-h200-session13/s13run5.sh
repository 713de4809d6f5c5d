#!/usr/bin/env bash
# session 13 run 5 (nvidia-h200, .whl carried): the attention benchmark's prefill and training rows on the
# final kernels (rows .no_wg: the Triton kernel side by side), then the warpgroup probe once more.
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" BENCH_ATTENTION_TIMEOUT=300 DEADLINE=330 \
  BENCH_ATTENTION_ARGS="--kinds prefill,train" bash tools/benchmarking/gpu_all_run.sh 2>&1 \
  | grep -E "prefill|train|rc=|step|Error" | grep -v -E "~|@" | cut -c1-200 | tail -40
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/tc timeout 200 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages 2x2x64,3x3x64 --repeats 21 2>&1 | grep -v "^  " | tail -30
