#!/usr/bin/env bash
# session 19 run 2 (nvidia-h200, .whl carried with s19base.tgz = 44c61b4's tree): the combine's
# group size (kernels.combine_group: 4 loads and 4 merges for a step of 4 KV splits, not 16):
# the decode benchmark, base tree and this tree side by side in alternating processes, batch 1 and
# 64 at 4096 and 32768 keys, contiguous and 16-token pages; then the paged batch-64 x 4096 step's
# tile candidates (tools/benchmarking/attention_decode_gpu.py: bits and time).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $W/base $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
tar -xzf .whl/s19base.tgz -C $W/base
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
ROWS='rlk.triton.blocked_online_softmax,*.paged16'
for tag in new base new2; do
  if [ $tag = base ]; then dir=$W/base; else dir=$PWD; fi
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout 130 python3 benchmarks/operators/bench_attention_gpu.py --kinds decode \
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
timeout $(( 585 - ($(date +%s) - START) )) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_configs.json \
  --cases 64x4096 --configs m16_w2_s2,m16_w2_s3,m16_w4_s2,m16_w2_s1 > $W/decode_configs.log 2>&1
echo "decode configs rc=$? $(( $(date +%s) - START ))s"; tail -30 $W/decode_configs.log
cp $W/*.log $OUT/
