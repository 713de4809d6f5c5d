#!/usr/bin/env bash
# session 5 run 1: ncu of the shipped prefill kernel vs the probe; ablation over shapes; decode config candidates
set -u
W=/tmp/w1; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:$W/site" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
T=tools/benchmarking/attention_ablation_gpu.py
NCU="ncu --clock-control none -k regex:rlk_attn_fwd|rlk_probe_attn_fwd --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
( timeout 150 $NCU python3 $T --out /dev/null --shapes 32x512 --once 'rlk.cached_forward(prefill: out)' > $OUT/ncu_shipped_32x512.txt 2>&1; echo ncu1 rc=$? ) 
( timeout 150 $NCU python3 $T --out /dev/null --shapes 32x512 --once '+ind (all shipped features)' > $OUT/ncu_probe_32x512.txt 2>&1; echo ncu2 rc=$? )
tail -5 $OUT/ncu_shipped_32x512.txt
timeout 150 python3 $T --out $OUT/ablation_shapes.json --shapes 128x128,32x512,8x1024,4x4096 --only 'ind \(all|cached|all_m64|textbook_bn64_w8_s3' > $W/abl.log 2>&1; echo abl rc=$?
cut -c1-200 $W/abl.log | tail -30
timeout 200 python3 benchmarks/operators/bench_attention_gpu.py --configs all --kinds decode --out $OUT/bench_attention_decode_configs.json > $W/cfg.log 2>&1; echo cfg rc=$?
tail -5 $W/cfg.log
