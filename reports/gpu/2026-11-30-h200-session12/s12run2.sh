#!/usr/bin/env bash
# session 12 run 2 (nvidia-h200, .whl carried; code of the score-pass experiment commit): the decode depth probe,
# one-pass vs score pass at 2-8 pipeline stages and per-kernel device time (torch profiler).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && mkdir -p $OUT && \
  PYTHONPATH=$PWD:/tmp/site TRITON_CACHE_DIR=/tmp/tc timeout 480 python3 tools/benchmarking/decode_depth_probe_gpu.py \
  --out $OUT/depth.json 2>&1 | tee $OUT/depth.log | grep -v Warning | cut -c1-250
