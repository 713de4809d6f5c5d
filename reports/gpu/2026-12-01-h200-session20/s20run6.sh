#!/usr/bin/env bash
# session 20 run 6 (nvidia-h200, .whl carried): deeper pipelines of the 64-column decode GEMM tile
# (more weight bytes in flight per SM) against the shipped tile and cuBLAS at the M <= 16 misses of
# runs 4-5 (qkv, gate_up, down at M = 1 and 16; tools/benchmarking/gemm_sweep.py, graph mode,
# candidate and cuBLAS sampled in turn).
set -uo pipefail
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
timeout 400 python3 tools/benchmarking/gemm_sweep.py --out $OUT/gemm_deep.json --skip-bits --shapes qkv gate_up down --ms 1 16 \
  --with-shipped --only 16x64x256_w4_s5_g8_tma 16x64x128_w4_s8_g8_tma 16x64x128_w4_s10_g8_tma 16x64x256_w8_s5_g8_tma \
  > $OUT/gemm_deep.log 2>&1
echo "gemm rc=$?"; grep -E "BEST" $OUT/gemm_deep.log
python3 - $OUT/gemm_deep.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])).get("speed", []):
    if "p50_us" in r:
        print(f"  {r['shape']:7s} M={r['M']:3d} {r['config']:30s} {r['p50_us']:8.2f} cublas {r['cublas_p50_us']:8.2f} {r['time_ratio']:.3f} {'shipped' if r['shipped'] else ''}")
    else:
        print("  ", r)
PY
