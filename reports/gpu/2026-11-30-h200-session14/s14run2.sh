#!/usr/bin/env bash
# session 14 run 2 (nvidia-h200, .whl carried): the warpgroup forward with the KV-split merge moved into a
# drained iteration; ring depths and a 160-register cap (three programs per SM): bits and time (probe)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 400 python3 tools/benchmarking/attention_wg_gpu.py \
  --out $OUT/wg_probe.json --stages ${STAGES:-2x2x64,2x1x64r160,1x2x64r160} --repeats 15 2>&1 | grep -v "^  " | tail -40
