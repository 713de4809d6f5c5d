#!/usr/bin/env bash
# One GPU job for the Triton gemm.linear target: environment, GPU test module, optional tile
# sweep, benchmark. Writes logs/JSON to $OUT (results.tar.gz holds everything; run.log too).
#
#   STEPS="tests sweep bench" bash tools/benchmarking/gpu_gemm_run.sh
#
# Carry .whl (pydantic & deps, missing on the device image): see tools/benchmarking/gpu_all_run.sh.
set -uo pipefail
OUT=${OUT:-/tmp/rlk_gpu_out}
STEPS=${STEPS:-"tests bench"}
WORK=/tmp/rlk_gpu_work
rm -rf "$WORK"; mkdir -p "$WORK/evidence" "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD"
fi
export RLK_EVIDENCE_DIR="$WORK/evidence" TRITON_CACHE_DIR=/tmp/rlk_triton_cache
{
  echo "== env $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, pydantic, hypothesis, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'pydantic', pydantic.__version__, 'hypothesis', hypothesis.__version__, 'pytest', pytest.__version__); print(torch.cuda.get_device_name(0))"
  git rev-parse HEAD 2>/dev/null || true
} 2>&1 | tee "$WORK/env.txt"

for step in $STEPS; do
  t0=$(date +%s)
  case $step in
    tests)
      # functional tests in parallel workers; the bounded-performance smoke alone (no contention)
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/backends/triton -q -n ${XDIST:-3} -p no:cacheprovider \
        -rs -k "not bounded_performance" --junitxml="$WORK/pytest_gpu.xml" 2>&1 | tee "$WORK/pytest_gpu.log" | tail -25
      timeout 120 python3 -m pytest tests/backends/triton -q -p no:cacheprovider -rs -k bounded_performance \
        --junitxml="$WORK/pytest_gpu_perf.xml" 2>&1 | tee "$WORK/pytest_gpu_perf.log" | tail -8 ;;
    sweep)
      timeout ${SWEEP_TIMEOUT:-240} python3 tools/benchmarking/gemm_sweep.py --out "$WORK/sweep.json" ${SWEEP_ARGS:-} 2>&1 \
        | tee "$WORK/sweep.log" | grep -v '^BITS' ; grep '^BITS' "$WORK/sweep.log" | grep -c '"fwd_equal": true' ;
      grep '^BITS' "$WORK/sweep.log" | grep -v '"fwd_equal": true, .*"dx_equal": true' | cut -c1-300 ;;
    bench)
      timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/operators/bench_gemm_gpu.py --out "$WORK/bench_gemm_gpu.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$WORK/bench.log" | tail -32 ;;
  esac
  echo "== step $step took $(( $(date +%s) - t0 )) s (rc ${PIPESTATUS[0]})"
done 2>&1 | tee "$WORK/run.log"
cp "$WORK/run.log" "$OUT/run.log"
tar -C "$WORK" -czf "$OUT/results.tar.gz" .
ls -la "$OUT"
