#!/usr/bin/env bash
# session 21 run 6 (nvidia-h200, .whl carried): on this session's rules, decode steps of batch 2, 8
# and 32 (more sizes a rollout passes through as sequences finish) at 512 / 4096 / 32768 keys,
# contiguous and 16-token pages: the shipped selection against the few- and many-programs tiles
# with one, two or four blocks a step and 2 value slices, raw bits against the shipped step and
# time with SDPA (tools/benchmarking/attention_decode_gpu.py).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
CFGS=m16_w4_s3,m16_w2_s2,m16_w4_s3_u2,m16_w2_s2_u2,m16_w4_s2_u2,m16_w4_s3_v2_u4,m16_w4_s2_v2_u4
for cases in 8x512,32x512 2x4096,8x4096,32x4096 2x32768,8x32768; do
  tag=${cases//,/_}
  timeout $(left 570) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_$tag.json --cases $cases \
    --configs $CFGS --repeats 9 > $W/decode_$tag.log 2>&1
  echo "decode $cases rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL" $W/decode_$tag.log
done
cp $W/*.log $OUT/
