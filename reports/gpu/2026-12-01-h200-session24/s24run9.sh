#!/usr/bin/env bash
# session 24 run 9 (nvidia-h200, .whl carried): the working tree with paged_quad_loader.patch
# (v2: the first two four-block steps' page copies issued before the tile's Q rows are loaded, as
# without a loader; the loader from step 2): the transposed kernel's bits tests, then the probe at
# run 7/8's paged steps.
set -uo pipefail
START=$(date +%s)
W=/tmp/w9; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
timeout 120 python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 10 -p no:cacheprovider -rs -q \
  -k "transposed_decode" --timeout 110 > $OUT/pytest_loader2.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|Error|assert|differ|Timeout" $OUT/pytest_loader2.log | cut -c1-300 | head -20
timeout 120 python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_loader2.json --cases 1x4096,1x1024,2x2048,4x1024,1x512 \
  --no-wg --wgt 2v2q2 --repeats 9 --profile paged16.shipped > $OUT/decode_loader2.log 2>&1
echo "decode probe rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error|kernels" $OUT/decode_loader2.log | cut -c1-200
