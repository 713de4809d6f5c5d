#!/usr/bin/env bash
# session 22 run 4 (nvidia-h200, .whl carried): steps of one KV split on the warpgroup kernel (its
# programs finish their rows, no combine). The warpgroup decode GPU tests (bits, band, profiler
# names) and the split-grid test, then the decode probe at 512 keys (one split) and two band
# cases: the shipped selection against the Triton kernels (--no-wg) and the warpgroup kernel forced.
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $W/out $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $W/out/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout $(left 200) python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 8 -p no:cacheprovider \
  -rs -k "warpgroup or split_grid_orders or profiler" --timeout 150 > $W/out/pytest_wgd.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|Error|assert" $W/out/pytest_wgd.log | cut -c1-300 | head -20
run() {  # cases specs
  tag=${1//,/_}
  timeout $(left 560) python3 tools/benchmarking/attention_decode_gpu.py --out $W/out/decode_$tag.json --cases $1 \
    --no-wg --wg-slots $2 --repeats 9 > $W/out/decode_$tag.log 2>&1
  echo "decode $1 rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error" $W/out/decode_$tag.log | grep -v contiguous | cut -c1-200
}
run 4x512,8x512,16x512 2
run 32x512,64x512 2
run 4x4096,1x32768 2
tar -czf $OUT/results.tgz -C $W/out .
