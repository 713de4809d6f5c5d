#!/usr/bin/env bash
# session 21 run 2 (nvidia-h200, .whl carried): decode steps of batch 4 and 16 (the sizes a rollout
# passes through as sequences finish) at 512 / 4096 / 32768 keys, contiguous and 16-token pages: the
# shipped selection against every decode tile family (few / many / middle programs, one, two or four
# blocks a step, 2 or 4 value slices), raw bits against the shipped step and time with SDPA
# (tools/benchmarking/attention_decode_gpu.py).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
CFGS=m16_w4_s3,m16_w2_s2,m16_w4_s2,m16_w4_s3_u2,m16_w2_s2_u2,m16_w4_s2_u2,m16_w4_s3_v2_u4,m16_w4_s2_v2_u4,m16_w4_s3_v4_u4,m16_w4_s2_v4_u4
for cases in 4x512,16x512 4x4096,16x4096 4x32768,16x32768; do
  tag=${cases//,/_}
  timeout $(left 570) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_$tag.json --cases $cases \
    --configs $CFGS --repeats 9 > $W/decode_$tag.log 2>&1
  echo "decode $cases rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL" $W/decode_$tag.log
done
cp $W/*.log $OUT/
