#!/usr/bin/env bash
# session 24 run 5 (nvidia-h200, .whl carried with s24base.tgz = fa57b33's tree): run 3 gave the
# prefill 4 x 4096 at 0.868 of SDPA (ours 1164 us, SDPA 1010 us; session 23: 1175 / 1095 us). The
# prefill benchmark again, base tree and this tree in alternating processes, 15 samples each.
set -uo pipefail
START=$(date +%s)
W=/tmp/w5; rm -rf $W; mkdir -p $W/site $W/base $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
tar -xzf .whl/s24base.tgz -C $W/base
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rlk_triton_cache
for tag in base new base2 new2; do
  case $tag in base*) dir=$W/base ;; *) dir=$PWD ;; esac
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout 100 python3 benchmarks/operators/bench_attention_gpu.py --kinds prefill \
     --rows rlk.triton.blocked_online_softmax --repeats 15 --out $OUT/bench_prefill_$tag.json > $W/bench_$tag.log 2>&1)
  echo "bench $tag rc=$? $(( $(date +%s) - START ))s"
  python3 - $OUT/bench_prefill_$tag.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = r["config"]
    print(f"  {r['implementation']:45s} {c['B']}x{c['S']} {r['median']*1e3:8.1f} us  {r.get('throughput_ratio')}")
PY
done
