#!/usr/bin/env bash
# session 22 run 6 (nvidia-h200, .whl carried): the rest of the GPU tests on this session's final
# tree, the attention benchmark of record (prefill; decode batch 1 / 2 / 4 / 8 / 16 / 64 at 512 /
# 4096 / 32768 keys, contiguous, 16-token pages, and those pages on the Triton kernels: .no_wg),
# then `rlk check --device cuda` (fp32 and bf16 R/R, the P/P control, bf16 past the first KV split
# at Qwen3-0.6B's dimensions, contiguous and paged). First, alone on the GPU, the programmatic-
# dependent-launch tests of the attention shard (run 5's one failure: the warpgroup forward's
# negative control, a race that the 16-process shard left uncaught in its five tries).
W0=/tmp/w0; rm -rf $W0; mkdir -p $W0/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $W0/site .whl/*.whl || exit 3
PYTHONPATH="$PWD:$W0/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 120 python3 -m pytest \
  tests/backends/shared/triton/test_attention_triton.py -m gpu -p no:cacheprovider -rs -v -k programmatic_dependent_launch \
  > $OUT/pytest_pdl_alone.log 2>&1
echo "pdl tests alone rc=$?"; grep -E "PASSED|FAILED|passed|failed" $OUT/pytest_pdl_alone.log | cut -c1-200
OUT=$OUT WORK=/tmp/w STEPS="tests bench_attention check_cuda" XDIST=16 DEADLINE=520 TESTS_TIMEOUT=320 \
  TEST_CASE_TIMEOUT=310 PERF_TIMEOUT=60 SHARD=rest BENCH_ATTENTION_TIMEOUT=120 CHECK_TIMEOUT=90 \
  BENCH_ATTENTION_ARGS="--kinds prefill,decode --decode-batch 1,2,4,8,16,64 --decode-ctx 512,4096,32768 --repeats 9 --rows rlk.triton.blocked_online_softmax,*.paged16,*.paged16.no_wg,*.train_forward" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch|softmax|sdpa|rlk check" | tail -80
