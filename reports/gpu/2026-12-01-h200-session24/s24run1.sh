#!/usr/bin/env bash
# session 24 run 1 (nvidia-h200, .whl carried with s24base.tgz = HEAD fa57b33's rl_engine, benchmarks,
# tools, tests, and s24big.tgz = this tree with the patch applied). Three trees: base (fa57b33), new (this tree: a contiguous
# cache's base row loaded beside the table row in the decode kernels; the combine reads its table
# row before it waits for the split kernel), big (new + the four-block step's four contiguous
# blocks as one 256-row TMA copy, s24_big.patch). (1) big's decode GPU tests (every changed kernel);
# (2) the decode benchmark, batch 1 and 4 x 512 / 4096 / 32768, trees alternating; (3) ncu of
# the batch-1 x 4096 contiguous step on new and big (source counters).
set -uo pipefail
START=$(date +%s)
W=/tmp/w; rm -rf $W; mkdir -p $W/site $W/base $W/big $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
tar -xzf .whl/s24base.tgz -C $W/base
tar -xzf .whl/s24big.tgz -C $W/big
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/env.txt 2>&1
left() { echo $(( $1 - ($(date +%s) - START) )); }
# (1) tests on big (it holds every change of new)
(cd $W/big && PYTHONPATH="$W/big:$W/site" timeout $(left 200) python3 -m pytest tests/backends/shared/triton/test_attention_triton.py \
  -m gpu -n 8 -p no:cacheprovider -rs -q --timeout 170 \
  -k "transposed_decode_gives or programmatic_dependent_launch_gives or decode_step_without or long_contexts or split_grid_orders_give_the_same_rows_on_gpu or decode_tma_loads_give" \
  > $OUT/pytest_big.log 2>&1)
echo "tests big rc=$? $(( $(date +%s) - START ))s"; grep -E "FAILED|ERROR|SKIPPED|differ|assert" $OUT/pytest_big.log | cut -c1-300 | head -20; tail -2 $OUT/pytest_big.log
# (2) decode benchmark, trees alternating
ROWS='rlk.triton.blocked_online_softmax,*.paged16'
for tag in base new big base2 new2 big2; do
  case $tag in base*) dir=$W/base ;; new*) dir=$PWD ;; big*) dir=$W/big ;; esac
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout $(left 470) python3 benchmarks/operators/bench_attention_gpu.py --kinds decode \
     --decode-batch 1,4 --decode-ctx 512,4096,32768 --rows "$ROWS" --repeats 9 --out $OUT/bench_decode_$tag.json > $W/bench_$tag.log 2>&1)
  echo "bench $tag rc=$? $(( $(date +%s) - START ))s"
done
python3 - $OUT <<'PY'
import json, sys, glob, collections
d = collections.defaultdict(dict)
for f in sorted(glob.glob(sys.argv[1] + "/bench_decode_*.json")):
    tag = f.split("bench_decode_")[1][:-5]
    for r in json.load(open(f))["rows"]:
        c = r["config"]; key = (c.get("B"), c.get("context"), r["implementation"])
        d[key][tag] = r["median"] * 1e6
tags = ["base", "new", "big", "base2", "new2", "big2"]
print("case".ljust(70), *[t.rjust(8) for t in tags])
for k in sorted(d, key=str):
    print(str(k).ljust(70), *[(f"{d[k][t]:8.2f}" if t in d[k] else "       -") for t in tags])
PY
# (3) ncu, batch 1 x 4096 contiguous: new and big
P=tools/benchmarking/attention_profile_once.py
for tag in new big; do
  if [ $tag = big ]; then dir=$W/big; else dir=$PWD; fi
  [ $(left 560) -lt 40 ] && break
  (cd $dir && PYTHONPATH="$dir:$W/site" timeout $(left 560) ncu --clock-control none --nvtx --nvtx-include "rlk_profile/" --set full \
     --import-source no -k regex:rlk_attn -f -o $W/ncu_$tag python3 $P --decode 1x4096 > $W/ncu_$tag.log 2>&1)
  echo "ncu $tag rc=$? $(( $(date +%s) - START ))s"; tail -2 $W/ncu_$tag.log
  ncu -i $W/ncu_$tag.ncu-rep --page details --print-details all > $W/ncu_${tag}_details.txt 2>&1
  ncu -i $W/ncu_$tag.ncu-rep --page source --print-source sass --csv > $W/ncu_${tag}_src.csv 2>&1
  python3 tools/benchmarking/ncu_sass_summary.py $W/ncu_${tag}_src.csv --kernel rlk_attn_split_wgt > $W/ncu_${tag}_sass.txt 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|DRAM Throughput|Warp Cycles Per Issued" $W/ncu_${tag}_details.txt | head -20
done
cp $W/*.log $W/ncu_*.txt $OUT/ 2>/dev/null
cd $OUT && tar -czf results.tgz *.log ncu_*.txt 2>/dev/null && rm -f ncu_*.txt bench_*.log ncu_*.log
ls $OUT
