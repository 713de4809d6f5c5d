#!/usr/bin/env bash
# session 26 run 2 (nvidia-h200, .whl carried): HEAD aeb66b8. (1) A small-M GEMM tile sweep (graph mode,
# each candidate sampled in turn with cuBLAS) for down / qkv / gate_up at M = 1, 16, 64: run 1's
# benchmark of record timed down M = 16 with 16x32x256 (6 stages) at 27.9 us against cuBLAS 29.7, while
# down M = 1 takes 16x64x256 (4 stages) at 31.3 us against 29.5. (2) The attention shard of the GPU
# tests on this tree (it takes 280-345 s: the step gets 440 s).
OUT=$OUT WORK=/tmp/w STEPS="sweep tests" XDIST=16 DEADLINE=590 SWEEP_TIMEOUT=130 \
  SWEEP_ARGS="--skip-bits --shapes down qkv gate_up --ms 1 16 64 --with-shipped --only 16x64x256_w4_s4_g8_tma 16x32x256_w4_s6_g8_tma 16x32x256_w4_s8_g8_tma 16x64x256_w4_s5_g8_tma 16x32x512_w4_s4_g8_tma 16x64x128_w4_s6_g8_tma 64x64x128_w4_s6_g8_tma 64x32x256_w4_s4_g8_tma 64x32x128_w4_s6_g8_tma 64x128x64_w4_s6_g8_tma" \
  TESTS_TIMEOUT=440 TEST_CASE_TIMEOUT=420 PERF_TIMEOUT=30 SHARD=attention \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "BEST|passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -60
