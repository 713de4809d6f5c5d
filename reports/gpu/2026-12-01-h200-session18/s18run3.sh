#!/usr/bin/env bash
# session 18 run 3 (nvidia-h200, .whl carried): the KV split size re-measured on today's kernels (quad steps,
# value slices, the Gluon train forward): the shipped rows beside `~sb8` rows (512-key splits, a benchmark-only
# override) for prefill, decode (batch 1 and 64 at 4096 and 32768 keys, contiguous and 16-token pages) and
# the training forward + backward.
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" DEADLINE=585 BENCH_ATTENTION_TIMEOUT=565 \
  BENCH_ATTENTION_ARGS="--kinds prefill,decode,train --decode-batch 1,64 --decode-ctx 4096,32768 --split-blocks 8 --repeats 9 --rows rlk.triton.blocked_online_softmax,*.paged16,*~sb8,*.train_forward" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 | tail -40
