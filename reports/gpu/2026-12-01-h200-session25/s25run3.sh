#!/usr/bin/env bash
# session 25 run 3 (nvidia-h200, .whl carried): host time of eager calls (GEMM layers, decode-step
# operators, attention step) on this tree, with a cProfile of the slow cases.
set -uo pipefail
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH=$PWD:/tmp/site python3 tools/benchmarking/host_overhead_gpu.py --out $OUT/host_overhead.json \
  --profile kernels custom_op public "rms_norm public" "silu_and_mul public" "decode attn kernels.cached_forward" \
  "decode attn paged_attention_step (per layer)" "decode step x36 layers: plan_cached_attention + cached_attention_step" \
  > $OUT/host_overhead.log 2>&1; echo rc=$?
head -30 $OUT/host_overhead.log
