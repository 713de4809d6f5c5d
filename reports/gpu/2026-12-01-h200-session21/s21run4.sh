#!/usr/bin/env bash
# session 21 run 4 (nvidia-h200, .whl carried with s21base.tgz = 3af28b5's tree): the attention shard
# of the GPU tests on this session's tree (decode rules: the many-pairs tile for steps of few pairs
# past one wave, two value slices over small pages, paired one-split contiguous steps; the shared
# pointer loads of a block), then the decode benchmark at batch 4 and 16, base tree and this tree
# in alternating processes.
START=$(date +%s)
OUT0=$OUT
OUT=$OUT/tests WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=470 TESTS_TIMEOUT=440 TEST_CASE_TIMEOUT=430 \
  PERF_TIMEOUT=40 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
echo "tests done $(( $(date +%s) - START ))s"
OUT=$OUT0
W=/tmp/w2; rm -rf $W; mkdir -p $W/site $W/base
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
tar -xzf .whl/s21base.tgz -C $W/base
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache
for tag in new base; do
  if [ $tag = base ]; then dir=$W/base; else dir=$PWD; fi
  left=$(( 585 - ($(date +%s) - START) )); [ $left -lt 5 ] && break
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout $left python3 benchmarks/operators/bench_attention_gpu.py --kinds decode \
     --decode-batch 4,16 --decode-ctx 512,4096 --rows 'rlk.triton.blocked_online_softmax,*.paged16' --repeats 7 \
     --out $OUT/bench_decode_$tag.json > $OUT/bench_decode_$tag.log 2>&1)
  echo "bench $tag rc=$? $(( $(date +%s) - START ))s"
  python3 - $OUT/bench_decode_$tag.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = r["config"]
    print(f"  {r['implementation']:45s} {c['B']}x{c['context']} {r['median']*1e3:8.2f} us  {r.get('throughput_ratio')}")
PY
done
