#!/usr/bin/env bash
# session 24 run 7 (nvidia-h200, .whl carried): the working tree with paged_quad_loader.patch
# applied (not shipped): four paged blocks a step on the transposed kernel, their page copies
# issued by a one-warp loader partition (gl.warp_specialize) that waits on the consumer's "slot
# free" barriers. (1) the transposed kernel's bits tests, whose forced four-block configurations
# (2 and 1 slots) now reach the paged caches too; (2) the decode probe, paged and contiguous,
# batch 1 / 2 x 4096 and 1 x 512, one block a step (q0) and four (q2).
set -uo pipefail
START=$(date +%s)
W=/tmp/w7; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
timeout 170 python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 9 -p no:cacheprovider -rs -q \
  -k "transposed_decode_gives" --timeout 160 > $OUT/pytest_loader.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|Error|assert|differ|Timeout" $OUT/pytest_loader.log | cut -c1-300 | head -20
timeout 150 python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_loader.json --cases 1x4096,2x4096,1x512 \
  --no-wg --wgt 2v2q0,2v2q2,2v2q1 --repeats 9 --profile paged16.wgt_s2v2q2 > $OUT/decode_loader.log 2>&1
echo "decode probe rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error|kernels" $OUT/decode_loader.log | cut -c1-200
