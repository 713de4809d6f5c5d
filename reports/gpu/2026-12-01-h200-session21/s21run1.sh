#!/usr/bin/env bash
# session 21 run 1 (nvidia-h200, .whl carried): batch-1 decode tile candidates against the shipped
# step (raw bits and time with SDPA, tools/benchmarking/attention_decode_gpu.py): the four-block
# tile with 3 stages over pages (shipped: 2), 8 value slices (256 programs; shipped: 4), 4 stages;
# and at 32768 keys 2 value slices on the pair walk (shipped: unsliced).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout $(left 330) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_4096.json --cases 1x4096,2x4096 \
  --configs m16_w4_s3_v4_u4,m16_w4_s2_v4_u4,m16_w4_s4_v4_u4,m16_w4_s3_v8_u4,m16_w4_s2_v8_u4 > $W/decode_4096.log 2>&1
echo "decode 4096 rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL" $W/decode_4096.log
timeout $(left 560) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_32768.json --cases 1x32768 \
  --configs m16_w4_s3_u2,m16_w2_s2_u2,m16_w4_s3_v2_u2,m16_w2_s2_v2_u2,m16_w2_s3_u2 > $W/decode_32768.log 2>&1
echo "decode 32768 rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL" $W/decode_32768.log
cp $W/*.log $OUT/
