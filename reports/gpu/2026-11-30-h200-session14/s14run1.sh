#!/usr/bin/env bash
# session 14 run 1 (nvidia-h200, .whl carried): Nsight Compute on the warpgroup forward and on SDPA's kernel (same
# shapes) -- where the warpgroup kernel's time goes (pipes, issue, shared memory, stalls per SASS line)
set -u
W=/tmp/w1; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:$W/site" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
P=tools/benchmarking/attention_profile_once.py
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
for spec in "wg 4x4096" "sdpa 4x4096" "wg 32x512" "sdpa 32x512"; do
  set -- $spec; tag=$1_$2
  SRC=""; [ $1 = wg ] && SRC="--import-source no --section SourceCounters"
  timeout 170 ncu --clock-control none --nvtx --nvtx-include "rlk_profile/" --set full $SRC -f -o $W/$tag \
    python3 $P --impl $1 --shape $2 > $W/ncu_$tag.log 2>&1; echo "ncu $tag rc=$?"; tail -2 $W/ncu_$tag.log
  ncu -i $W/$tag.ncu-rep --page details --print-details all > $OUT/ncu_$tag.txt 2>&1
  ncu -i $W/$tag.ncu-rep --page raw --csv > $W/raw_$tag.csv 2>&1
  [ $1 = wg ] && ncu -i $W/$tag.ncu-rep --page source --print-source sass --csv > $W/src_$tag.csv 2>&1
done
tar -C $W -czf $OUT/raw.tgz $(cd $W && ls *.csv ncu_*.log)
grep -h -E "^  [a-zA-Z_].*(void|rlk|fmha|flash|cudnn|sm90)|Duration|Registers Per|Threads  |Block Size|Grid Size|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Achieved Occupancy|Shared Memory Configuration|Dynamic Shared" $OUT/ncu_*.txt | cut -c1-150 | head -80
