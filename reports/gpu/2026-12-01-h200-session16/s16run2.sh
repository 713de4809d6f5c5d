#!/usr/bin/env bash
# session 16 run 2 (nvidia-h200, .whl carried): the shipped rule (kernels.quad_blocks: four blocks a step where the
# few-programs step is value-sliced); the decode probe over batch 1 / 2 / 4 with the shipped selection, more
# slicings and walks, and the per-kernel device time of the shipped batch-1 steps (torch profiler).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache
timeout 400 python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_probe.json \
  --cases 1x4096,2x4096,1x512,1x32768,4x4096 \
  --configs m16_w4_s3_v4_u4,m16_w4_s3_v4_u2,m16_w4_s2_v8_u4,m16_w4_s3_v8_u4,m16_w4_s2_v4_u4,m16_w2_s2_v4_u4,m16_w4_s3_v2_u4,m16_w4_s3_v2_u2 \
  --profile contiguous.shipped,paged16.shipped 2>&1 | grep -v Warning | tail -120
echo "probe rc=$?"
