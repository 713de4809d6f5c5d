#!/usr/bin/env bash
# session 20 run 5 (nvidia-h200, .whl carried): the GEMM benchmark against cuBLAS three times in
# one call (run 4's single run missed four M >= 1024 points by 1-5 %, where session 11 met 12 of
# 12 on the same kernels): the run-to-run spread of the ratios.
for i in 1 2 3; do
  OUT=$OUT/g$i WORK=/tmp/w$i STEPS="bench_gemm" DEADLINE=150 \
    bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -E "step|True|False" | awk -v i=$i '{print "run" i ": " $0}'
  rm -f $OUT/g$i/results.tgz $OUT/g$i/run.log
done
