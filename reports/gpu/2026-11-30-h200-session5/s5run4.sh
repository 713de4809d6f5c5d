#!/usr/bin/env bash
# session 5 run 4 (nvidia-h200): where the shipped prefill kernel loses to the probe: table/guard probe variants; ncu stall reasons + SASS hot spots
set -u
W=/tmp/w4; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:$W/site" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
T=tools/benchmarking/attention_ablation_gpu.py
timeout 120 python3 $T --out $OUT/ablation_table.json --shapes 128x128,32x512,8x1024,4x4096 --only 'ind|cached' > $W/abl.log 2>&1; echo abl rc=$?
python3 -c "
import json; d=json.load(open('$OUT/ablation_table.json'))
for r in d['rows']: print(r['case'], r['impl'][:40].ljust(40), round(r.get('p50_ms',0)*1000,1), r.get('throughput_vs_sdpa'), r.get('error','')[:200])"
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__cycles_active.avg,smsp__warps_active.avg.per_cycle_active'
for name in 'rlk.cached_forward(prefill: out)' 'probe:+ind (all shipped features)' 'probe:+ind+table+guard'; do
  tag=$(echo "$name" | tr -c 'a-zA-Z0-9' _ | cut -c1-30)
  timeout 150 ncu --clock-control none -k 'regex:rlk_attn_fwd$|rlk_probe_attn_fwd' --launch-skip 1 --launch-count 1 --metrics "$M" \
    --section SourceCounters --section LaunchStats -f -o $W/$tag python3 $T --out /dev/null --shapes 8x1024 --once "$name" > $W/ncu_$tag.log 2>&1
  echo "ncu $name rc=$?"
  ncu -i $W/$tag.ncu-rep --page details --print-details all > $OUT/ncu_$tag.txt 2>&1
  ncu -i $W/$tag.ncu-rep --page source --print-source sass --csv > $W/src_$tag.csv 2>&1; echo "src rc=$? $(wc -c < $W/src_$tag.csv)"
done
tar -C $W -czf $OUT/src.tgz $(cd $W && ls src_*.csv ncu_*.log)
grep -h -E "stalled_(long_scoreboard|barrier|wait|short_scoreboard|math|mio|no_inst|branch|dispatch|lg_thr|not_sel|selected|membar|sleep|drain|imc|tex)|inst_executed.sum|cycles_active.avg|warps_active" $OUT/ncu_*.txt | head -80
