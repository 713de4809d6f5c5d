#!/usr/bin/env bash
# session 20 run 2 (nvidia-h200, .whl carried): the attention shard of the GPU tests on this
# session's tree (paged walks loading page-table entries one step ahead), the bounded-performance
# smoke, then batch-1 × 32768-key decode tile candidates over both caches (bits against the
# shipped step and time, tools/benchmarking/attention_decode_gpu.py).
START=$(date +%s)
OUT=$OUT/tests WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=480 TESTS_TIMEOUT=440 TEST_CASE_TIMEOUT=430 \
  PERF_TIMEOUT=40 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
echo "tests done $(( $(date +%s) - START ))s"
W=/tmp/w2; rm -rf $W; mkdir -p $W/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
timeout $(( 590 - ($(date +%s) - START) )) python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_configs.json \
  --cases 1x32768 --configs m16_w2_s2,m16_w2_s2_v2,m16_w2_s2_v2_u2,m16_w4_s2_v2_u4 > $OUT/decode_configs.log 2>&1
echo "decode configs rc=$? $(( $(date +%s) - START ))s"; grep -E "us |FAIL" $OUT/decode_configs.log
