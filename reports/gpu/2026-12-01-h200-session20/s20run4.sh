#!/usr/bin/env bash
# session 20 run 4 (nvidia-h200, .whl carried): `rlk check --device cuda` on this session's final
# tree (fp32 and bf16 R/R, the P/P control, bf16 past the first KV split at Qwen3-0.6B's
# dimensions over contiguous and paged rollout caches), then the GEMM benchmark against cuBLAS
# and the fused LM-head benchmark (naive and Liger-Kernel side by side) of record.
OUT=$OUT WORK=/tmp/w STEPS="check_cuda bench_gemm bench_logprob" DEADLINE=480 CHECK_TIMEOUT=90 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-300 \
  | grep -E "rc=|rlk check|mismatch|step|Error|ratio|BEST|x0\.|x1\.|peak|naive|liger|fused" | tail -70
