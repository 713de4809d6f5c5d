#!/usr/bin/env bash
# session 25 run 4 (nvidia-h200, .whl carried, with .whl/s25base.tgz = `git archive` of commit
# "attention: the transposed kernel's four-block step over pages ..." (session 25's first commit)
# plus this tree's tools/benchmarking/host_overhead_gpu.py): the host-time change (cached Gluon
# host layouts, cached registry answers). First the attention shard of the GPU tests and
# `rlk check --device cuda` on this tree, then the host time of eager calls, base and this tree
# in alternating processes (two rounds).
OUT=$OUT WORK=/tmp/w STEPS="tests check_cuda" XDIST=16 DEADLINE=400 TESTS_TIMEOUT=330 TEST_CASE_TIMEOUT=320 \
  PERF_TIMEOUT=30 SHARD=attention CHECK_TIMEOUT=40 CHECK_RUNS="--dtype float32;--dtype bfloat16;--dtype bfloat16 --plan P/P" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error|assert|mismatch" | tail -30
python3 tools/benchmarking/trees_ab_gpu.py --tree base=.whl/s25base.tgz --tree new=. --rounds 2 --deadline 170 \
  --out-dir $OUT/ab --site /tmp/w/site -- tools/benchmarking/host_overhead_gpu.py 2>&1 | cut -c1-200
tar -C $OUT -czf $OUT/ab.tgz ab && rm -rf $OUT/ab
