#!/usr/bin/env bash
# session 23 run 1 (nvidia-h200, .whl carried): the transposed decode split kernel
# (hopper.rlk_attn_split_wgt, scores k·qᵀ with the tile's query rows as the wgmma's N). Its GPU
# bits tests (against the Triton kernels and the varlen rows), the warpgroup decode tests whose
# references now turn both Hopper decode kernels off, the profiler-name test; then the decode
# probe: the Triton kernels (--no-wg) against the transposed kernel forced at every size with
# 2 / 3 / 4 ring slots and 1 / 2 value slices, batch 1-8.
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout $(left 240) python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 8 -p no:cacheprovider \
  -rs -k "transposed or warpgroup_paged_decode or warpgroup_profiler" --timeout 200 > $OUT/pytest_wgt.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|Error|assert|differ" $OUT/pytest_wgt.log | cut -c1-400 | head -30
for cases in 1x4096,1x512 2x4096,1x32768 4x4096,8x512; do
  tag=${cases//,/_}
  timeout $(left 560) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_$tag.json --cases $cases \
    --no-wg --wgt 2v1,2v2,3v2,4v2 --repeats 9 \
    --profile contiguous.shipped,paged16.shipped,contiguous.no_wg,paged16.no_wg > $OUT/decode_$tag.log 2>&1
  echo "decode $cases rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error|kernels" $OUT/decode_$tag.log | cut -c1-200
done
tar czf $OUT/results.tgz -C $OUT --exclude results.tgz . 2>/dev/null
