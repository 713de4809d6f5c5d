#!/usr/bin/env bash
# session 24 run 4 (nvidia-h200, .whl carried): the final tree's decode probe around batch 1-4 x
# 4096 keys: the Triton kernels (--no-wg), the shipped selection, and the transposed kernel forced
# at one block a step (q0) and four (q2: two four-block slots, one program an SM; q1: one slot),
# both caches, to see where the one-copy four-block step should take over next.
W=/tmp/w4; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
timeout 280 python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_probe.json --cases 1x4096,2x4096,4x4096,1x16384 \
  --no-wg --wgt 2v2q0,2v2q2,2v2q1 --repeats 9 > $OUT/decode_probe.log 2>&1
echo "decode probe rc=$?"; grep -E "us |FAIL|Error" $OUT/decode_probe.log | cut -c1-200
