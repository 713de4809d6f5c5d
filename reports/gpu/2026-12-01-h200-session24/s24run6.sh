#!/usr/bin/env bash
# session 24 run 6 (nvidia-h200, .whl carried): ncu of batch-1 x 4096 decode steps for the next
# session: the shipped contiguous step (the transposed kernel, four blocks a step, one 256-row copy),
# the shipped paged step (the Triton split kernel, 16-token pages), the paged step on the transposed
# kernel (one block a step, four page copies a block), and SDPA's decode.
set -uo pipefail
START=$(date +%s)
W=/tmp/w6; rm -rf $W; mkdir -p $W/site $W/r $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
P=tools/benchmarking/attention_profile_once.py
for c in "contiguous_shipped|--decode 1x4096" "paged_shipped|--decode 1x4096 --paged" "paged_wgt|--decode 1x4096 --paged --decode-kernel wgt" \
         "sdpa|--decode 1x4096 --impl sdpa"; do
  tag=${c%%|*}; args=${c#*|}
  [ $(( 560 - ($(date +%s) - START) )) -lt 40 ] && break
  timeout 120 ncu --clock-control none --nvtx --nvtx-include "rlk_profile/" --set full --import-source no -f -o $W/$tag \
    python3 $P $args > $W/r/ncu_$tag.log 2>&1
  echo "ncu $tag rc=$? $(( $(date +%s) - START ))s"
  ncu -i $W/$tag.ncu-rep --page details --print-details all > $W/r/${tag}_details.txt 2>&1
  ncu -i $W/$tag.ncu-rep --page source --print-source sass --csv > $W/r/${tag}_src.csv 2>&1
  for k in rlk_attn_split_wgt rlk_attn_fwd_split rlk_attn_combine; do
    grep -q "$k" $W/r/${tag}_src.csv && python3 tools/benchmarking/ncu_sass_summary.py $W/r/${tag}_src.csv --kernel $k > $W/r/${tag}_${k}_sass.txt 2>&1
  done
  grep -E "^  [a-z_0-9]+.*\(|Duration|Registers Per|Issue Slots Busy|DRAM Throughput|Warp Cycles Per Issued|Grid Size|Block Size" $W/r/${tag}_details.txt | grep -v "^ *$" | head -24
done
rm -f $W/r/*_src.csv
tar -czf $OUT/ncu_results.tgz -C $W/r .
ls -la $OUT
