#!/usr/bin/env bash
# session 23 run 2 (nvidia-h200, .whl carried): the transposed decode split kernel with four
# blocks a step (rlk_attn_wgt_quad). Its GPU bits tests (one block a step at 3 / 4 slots, four
# blocks a step at 2 / 1 four-block slots), the warpgroup decode and profiler-name tests; then the
# decode probe: the Triton kernels (--no-wg) against the transposed kernel forced at every size,
# one block a step (q0) and four (q2, q1: four-block ring slots), batch 1-4.
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
for cases in 1x4096,1x512 2x4096,1x16384 1x32768,4x512; do
  tag=${cases//,/_}
  timeout $(left 560) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_$tag.json --cases $cases \
    --no-wg --wgt 2v2q0,2v2q2,2v2q1,2v1q0 --repeats 9 \
    --profile contiguous.shipped,paged16.shipped,contiguous.no_wg,paged16.no_wg > $OUT/decode_$tag.log 2>&1
  echo "decode $cases rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error|kernels" $OUT/decode_$tag.log | cut -c1-200
done
tar czf $OUT/results.tgz -C $OUT --exclude results.tgz . 2>/dev/null
