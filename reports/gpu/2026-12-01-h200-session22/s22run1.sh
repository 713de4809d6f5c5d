#!/usr/bin/env bash
# session 22 run 1 (nvidia-h200, .whl carried): the Gluon paged decode split kernel
# (hopper.rlk_attn_split_wg: each block's 16-key pages as four TMA copies into one shared-memory
# block). Its GPU bits test and the split-grid test (paged steps now take it), then the decode
# probe with --no-wg (the same steps on the Triton split kernel) at batch 1-64.
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout $(left 200) python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 8 -p no:cacheprovider \
  -rs -k "warpgroup_paged_decode or split_grid_orders" --timeout 150 > $OUT/pytest_wgd.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|Error|assert" $OUT/pytest_wgd.log | cut -c1-300 | head -20
for cases in 1x4096,1x32768 2x4096,4x4096 16x512,16x4096 64x4096,4x32768; do
  tag=${cases//,/_}
  timeout $(left 575) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_$tag.json --cases $cases \
    --no-wg --repeats 9 > $OUT/decode_$tag.log 2>&1
  echo "decode $cases rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error" $OUT/decode_$tag.log | cut -c1-200
done
