#!/usr/bin/env bash
# session 24 run 8 (nvidia-h200, .whl carried): the working tree with paged_quad_loader.patch
# applied, as run 7: the decode probe at the other steps of at most one program an SM (where four
# blocks a step can run: two four-block slots take 207-221 KiB), paged and contiguous.
W=/tmp/w8; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
timeout 200 python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_loader_band.json \
  --cases 1x1024,1x2048,2x2048,4x512,8x512,4x1024 --no-wg --wgt 2v2q0,2v2q2 --repeats 9 > $OUT/decode_loader_band.log 2>&1
echo "decode probe rc=$?"; grep -E "us |FAIL|Error" $OUT/decode_loader_band.log | cut -c1-200
