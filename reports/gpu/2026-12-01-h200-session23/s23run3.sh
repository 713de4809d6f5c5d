#!/usr/bin/env bash
# session 23 run 3 (nvidia-h200, .whl carried): the attention shard of the GPU tests on this
# session's final tree (the transposed decode split kernel, one and four blocks a step, its bands
# taking precedence over the warpgroup kernel's; every other attention test, whose decode steps in
# the bands now take it); then the decode probe past the measured sizes, inside the band's upper
# end: batch 8 x 4096, 16 x 512, 32 x 512 (the Triton kernels, the shipped selection, the
# transposed kernel forced).
START=$(date +%s)
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=450 TESTS_TIMEOUT=430 TEST_CASE_TIMEOUT=420 \
  PERF_TIMEOUT=40 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
export PYTHONPATH="$PWD:/tmp/w/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONUNBUFFERED=1
left=$(( 585 - ($(date +%s) - START) ))
timeout $left python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_band_top.json \
  --cases 8x4096,16x512,32x512 --no-wg --wgt 2v2 --repeats 9 > $OUT/decode_band_top.log 2>&1
echo "decode probe rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL|Error" $OUT/decode_band_top.log | cut -c1-200
