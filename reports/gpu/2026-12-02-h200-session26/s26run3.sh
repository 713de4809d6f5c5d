#!/usr/bin/env bash
# session 26 run 3 (nvidia-h200, .whl carried): HEAD aeb66b8 again, a second sample of the benchmarks
# of record. The GEMM benchmark in graph mode with the shapes in the reverse order (down first, qkv
# last): run 1 (default order: qkv, gate_up, down, lm_head) timed down M = 1 at 1.057x cuBLAS after
# gate_up M = 16384, while run 2's sweep (down first, a cool GPU) timed the same tile at 0.993x; this
# run tells whether the order (the GPU's state after minutes of heavy GEMMs) moves the ratio. Then
# the attention benchmark as in run 1.
OUT=$OUT WORK=/tmp/w STEPS="bench_gemm bench_attention" DEADLINE=560 BENCH_GEMM_TIMEOUT=200 \
  BENCH_GEMM_ARGS="--shapes down lm_head gate_up qkv --modes graph" BENCH_ATTENTION_TIMEOUT=150 \
  BENCH_ATTENTION_ARGS="--kinds prefill,decode --decode-batch 1,4,16,64 --decode-ctx 512,4096,32768 --repeats 9 --rows rlk.triton.blocked_online_softmax,*.paged16,*.paged16.no_wg,*.no_wgt,*.train_forward" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|Error|rc=|step|ratio|best|True|False" | tail -80
