#!/usr/bin/env bash
# session 19 run 3 (nvidia-h200, .whl carried): the split kernel's grid order (kernels.split_grid:
# tiles / kv heads / splits fastest) side by side in the decode benchmark, batch 1 and 64 at 4096
# and 32768 keys, contiguous and 16-token pages; then the decode, split, combine, paged and PDL
# GPU tests of the attention module on this tree (combine groups, grid switch, warpgroup PDL).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
timeout 200 python3 benchmarks/operators/bench_attention_gpu.py --kinds decode --decode-batch 1,64 --decode-ctx 4096,32768 \
  --rows 'rlk.triton.blocked_online_softmax,*.paged16,*.grid_*' --repeats 9 --out $OUT/bench_decode_grid.json > $OUT/bench_decode_grid.log 2>&1
echo "bench rc=$? $(( $(date +%s) - START ))s"
python3 - $OUT/bench_decode_grid.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = r["config"]
    print(f"  {r['implementation']:52s} {c['B']}x{c['context']} {r['median']*1e3:8.2f} us  {r.get('throughput_ratio')}")
PY
timeout $(( 585 - ($(date +%s) - START) )) python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 16 \
  -p no:cacheprovider -rs -q -k "decode or split or combine or paged or dependent" --timeout 300 > $OUT/pytest_gpu.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; grep -E "FAILED|ERROR|SKIPPED" $OUT/pytest_gpu.log | cut -c1-200 | head -20; tail -2 $OUT/pytest_gpu.log
