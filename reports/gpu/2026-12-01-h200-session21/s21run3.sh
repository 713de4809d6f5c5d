#!/usr/bin/env bash
# session 21 run 3 (nvidia-h200, .whl carried): 2 against 4 value slices on the four-block decode
# tile (3 stages: the contiguous few-programs tile; 2 stages: the paged one) at 8-64 programs
# (batch 1, 2, 8 at 512 keys; batch 1, 2 at 4096 keys), raw bits against the shipped step and time
# with SDPA (tools/benchmarking/attention_decode_gpu.py).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout $(left 300) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_slices.json \
  --cases 1x512,2x512,8x512,1x4096,2x4096 --configs m16_w4_s2_v2_u4,m16_w4_s2_v4_u4,m16_w4_s3_v2_u4,m16_w4_s3_v4_u4 \
  > $W/decode_slices.log 2>&1
echo "decode slices rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL" $W/decode_slices.log
cp $W/*.log $OUT/
