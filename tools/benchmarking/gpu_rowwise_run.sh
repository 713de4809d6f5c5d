#!/usr/bin/env bash
# One GPU job for the Triton row-wise operator targets (norm, activation, rope, embedding,
# logprob): environment, then the GPU test modules in parallel workers. Writes the junit XML,
# the verbose log (test names, so a run stopped at its time limit still shows what finished)
# and the tests' evidence JSON (profiler names, bounded-performance numbers) to $OUT.
#
#   MODULES="tests/backends/triton" KEXPR="not gemm" bash tools/benchmarking/gpu_rowwise_run.sh
#
# Carry .whl (pydantic & deps, missing on the device image): see tools/benchmarking/gpu_all_run.sh.
set -uo pipefail
OUT=${OUT:-/tmp/rlk_gpu_out}
mkdir -p "$OUT/evidence"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH="$PWD:/tmp/site"
else
  export PYTHONPATH="$PWD"
fi
export RLK_EVIDENCE_DIR="$OUT/evidence" TRITON_CACHE_DIR=/tmp/rlk_triton_cache
{
  echo "== env $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, pydantic, hypothesis, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'pydantic', pydantic.__version__, 'hypothesis', hypothesis.__version__, 'pytest', pytest.__version__); print(torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
timeout ${TESTS_TIMEOUT:-180} python3 -m pytest ${MODULES:-tests/backends/triton} -v -n ${XDIST:-8} -p no:cacheprovider \
  -rs -k "${KEXPR:-not bounded_performance}" --durations=30 --junitxml="$OUT/pytest_gpu_rowwise.xml" 2>&1 \
  | grep -v -e PytestBenchmarkWarning -e 'warner(' > "$OUT/pytest_gpu_rowwise.log"
echo "== tests took $(( $(date +%s) - t0 )) s"
grep -c " PASSED " "$OUT/pytest_gpu_rowwise.log"; grep -E " (FAILED|ERROR|SKIPPED) " "$OUT/pytest_gpu_rowwise.log" | head -30
tail -45 "$OUT/pytest_gpu_rowwise.log"
