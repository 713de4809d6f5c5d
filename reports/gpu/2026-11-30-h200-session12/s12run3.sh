#!/usr/bin/env bash
# session 12 run 3 (nvidia-h200, .whl carried): the batch-1 decode walk's ablation
# (tools/benchmarking/decode_ablation_gpu.py) beside the shipped step and SDPA.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && mkdir -p $OUT && \
  PYTHONPATH=$PWD:/tmp/site TRITON_CACHE_DIR=/tmp/tc timeout 500 python3 tools/benchmarking/decode_ablation_gpu.py \
  --out $OUT/decode_ablation.json 2>&1 | tee $OUT/decode_ablation.log | grep -v Warning | cut -c1-200
