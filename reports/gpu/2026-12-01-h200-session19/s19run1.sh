#!/usr/bin/env bash
# session 19 run 1 (nvidia-h200, .whl carried with s19base.tgz = the tree of 44c61b4's rl_engine,
# benchmarks, tools): (1) the warpgroup forward under programmatic dependent launch and without
# the page-rows cast kernel: its GPU tests; (2) the prefill benchmark, the base tree and this tree
# side by side in alternating processes; (3) ncu of the decode split kernel, batch 64 and 1 at
# 4096 keys, contiguous against 16-token pages.
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $W/base $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
tar -xzf .whl/s19base.tgz -C $W/base
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache
export PYTHONPATH="$PWD:$W/site"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
# (1) tests
timeout 200 python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 8 -p no:cacheprovider -rs -q \
  -k "dependent or hopper or warpgroup or wg or varlen or profiler" --timeout 190 > $OUT/pytest_gpu.log 2>&1
echo "tests rc=$? $(( $(date +%s) - START ))s"; grep -E "FAILED|ERROR|SKIPPED" $OUT/pytest_gpu.log | head -20; tail -2 $OUT/pytest_gpu.log
# (2) prefill: this tree, the base tree, this tree
ROWS='rlk.triton.blocked_online_softmax,*.train_forward,*.no_pdl'
for tag in new base new2; do
  if [ $tag = base ]; then dir=$W/base; else dir=$PWD; fi
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout 100 python3 benchmarks/operators/bench_attention_gpu.py --kinds prefill \
     --rows "$ROWS" --repeats 9 --out $OUT/bench_prefill_$tag.json > $W/bench_prefill_$tag.log 2>&1)
  echo "bench $tag rc=$? $(( $(date +%s) - START ))s"
  python3 - $OUT/bench_prefill_$tag.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"  {r['implementation']:55s} {r['config']['B']}x{r['config']['S']} {r['median']*1e3:8.1f} us  {r.get('throughput_ratio')}")
PY
done
# (3) ncu of the decode split kernel
P=tools/benchmarking/attention_profile_once.py
for c in "64x4096" "64x4096 --paged" "1x4096" "1x4096 --paged"; do
  tag=$(echo "$c" | tr -c 'a-zA-Z0-9' _)
  timeout 90 ncu --clock-control none --nvtx --nvtx-include "rlk_profile/" --set full -k regex:rlk_attn -f -o $W/$tag \
    python3 $P --decode $c > $W/ncu_$tag.log 2>&1; echo "ncu $c rc=$? $(( $(date +%s) - START ))s"; tail -2 $W/ncu_$tag.log
  ncu -i $W/$tag.ncu-rep --page details --print-details all > $W/ncu_$tag.txt 2>&1
  ncu -i $W/$tag.ncu-rep --page raw --csv > $W/raw_$tag.csv 2>&1
done
cp $W/*.log $W/ncu_*.txt $W/raw_*.csv $OUT/ 2>/dev/null
cd $OUT && tar -czf results.tgz *.log ncu_*.txt raw_*.csv 2>/dev/null && rm -f ncu_*.txt raw_*.csv bench_prefill_*.log ncu_*.log
ls $OUT
