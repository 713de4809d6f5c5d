#!/usr/bin/env bash
# session 22 run 2 (nvidia-h200, .whl carried): the Gluon paged decode split kernel
# after run 1: the first blocks' copies issued before the Q load, value slices, ring slots per
# launch (hopper.split_configured). Its GPU bits test and the split-grid test, then the decode
# probe: the Triton split kernel (--no-wg) against ring slots 2 / 3 / 4 / 6, with the automatic
# value slices and with one slice (v1), batch 1-64.
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
for cases in 1x4096,1x32768 2x4096,4x4096 8x4096,16x4096 64x4096,4x32768 64x32768; do
  tag=${cases//,/_}
  timeout $(left 575) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_$tag.json --cases $cases \
    --no-wg --wg-slots 2,3,4,6,3v1,6v1 --repeats 9 --profile paged16.shipped,paged16.no_wg > $OUT/decode_$tag.log 2>&1
  echo "decode $cases rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error|kernels" $OUT/decode_$tag.log | cut -c1-200
done
