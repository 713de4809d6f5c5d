#!/usr/bin/env bash
# session 13 run 1 (nvidia-h200, .whl carried): the Hopper warpgroup forward (hopper.rlk_attn_fwd_wg) against
# the Triton kernel: raw bits on six packed cases, then time at four TMA ring depths beside SDPA.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 500 python3 tools/benchmarking/attention_wg_gpu.py --out $OUT/wg_probe.json $PROBE_ARGS 2>&1 | tee $OUT/wg_probe.log | grep -v "^  " | tail -60
