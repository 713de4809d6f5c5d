#!/usr/bin/env bash
# session 21 run 7 (nvidia-h200, .whl carried with s21base.tgz = 25e60ac's tree): the few-programs
# decode tile only where its programs fit one wave (no longer for every step of more than 4 KV
# splits): the decode benchmark at batch 1 / 2 / 4 / 8 / 16 and 32768 keys, this tree and the base
# tree in alternating processes.
START=$(date +%s)
W=/tmp/w2; rm -rf $W; mkdir -p $W/site $W/base $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
tar -xzf .whl/s21base.tgz -C $W/base
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
for tag in new base new2; do
  if [ $tag = base ]; then dir=$W/base; else dir=$PWD; fi
  left=$(( 280 - ($(date +%s) - START) )); [ $left -lt 5 ] && break
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout $left python3 benchmarks/operators/bench_attention_gpu.py --kinds decode \
     --decode-batch 1,2,4,8,16 --decode-ctx 32768 --rows 'rlk.triton.blocked_online_softmax,*.paged16' --repeats 7 \
     --out $OUT/bench_decode_$tag.json > $OUT/bench_decode_$tag.log 2>&1)
  echo "bench $tag rc=$? $(( $(date +%s) - START ))s"
  python3 - $OUT/bench_decode_$tag.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = r["config"]
    print(f"  {r['implementation']:45s} {c['B']}x{c['context']} {r['median']*1e3:8.2f} us  {r.get('throughput_ratio')}")
PY
done
