#!/usr/bin/env bash
# session 20 run 1 (nvidia-h200, .whl carried with s20base.tgz = 0b291bc's tree): page-table
# entries loaded one step ahead in the paged walks (one block, pair and the four-block walk),
# the decode benchmark, base tree and this tree side by side in alternating processes, batch 1
# and 64 at 4096 and 32768 keys, contiguous and 16-token pages; then decode tile candidates at
# batch 1 (bits against the shipped step and time, tools/benchmarking/attention_decode_gpu.py);
# then 16-column GEMM tiles for the decode-sized down / qkv projections (gemm_sweep.py).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $W/base $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
tar -xzf .whl/s20base.tgz -C $W/base
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
ROWS='rlk.triton.blocked_online_softmax,*.paged16'
for tag in new base new2; do
  if [ $tag = base ]; then dir=$W/base; else dir=$PWD; fi
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout 120 python3 benchmarks/operators/bench_attention_gpu.py --kinds decode \
     --decode-batch 1,64 --decode-ctx 4096,32768 --rows "$ROWS" --repeats 9 --out $OUT/bench_decode_$tag.json > $W/bench_decode_$tag.log 2>&1)
  echo "bench $tag rc=$? $(( $(date +%s) - START ))s"
  python3 - $OUT/bench_decode_$tag.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = r["config"]
    print(f"  {r['implementation']:45s} {c['B']}x{c['context']} {r['median']*1e3:8.2f} us  {r.get('throughput_ratio')}")
PY
done
export PYTHONPATH="$PWD:$W/site"
timeout $(left 480) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_configs.json --cases 1x4096,1x32768 \
  --configs m16_w8_s3_v4_u4,m16_w8_s2_v4_u4,m16_w4_s2_u2,m16_w2_s3_u2 > $W/decode_configs.log 2>&1
echo "decode configs rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL" $W/decode_configs.log
timeout $(left 580) python3 tools/benchmarking/gemm_sweep.py --out $OUT/gemm_small.json --skip-bits --shapes down qkv --ms 1 16 \
  --with-shipped --only 16x16x512_w4_s4_g8_tma 16x16x256_w2_s8_g8_tma 16x16x512_w2_s6_g8_tma 16x32x256_w4_s6_g8_tma > $W/gemm_small.log 2>&1
echo "gemm rc=$? $(( $(date +%s) - START ))s"; grep -E "BEST" $W/gemm_small.log
python3 - $OUT/gemm_small.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no gemm json", e); raise SystemExit
rows = d.get("speed", [])
for r in rows if isinstance(rows, list) else []:
    if "p50_us" in r:
        print(f"  {r['shape']:6s} M={r['M']:3d} {r['config']:32s} {r['p50_us']:8.2f} cublas {r['cublas_p50_us']:8.2f} {r['time_ratio']:.3f} {'shipped' if r['shipped'] else ''}")
PY
cp $W/*.log $OUT/
