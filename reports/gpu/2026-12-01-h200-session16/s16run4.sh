#!/usr/bin/env bash
# session 16 run 4 (nvidia-h200, .whl carried), the final code: the two GPU tests run 3 left (the fused LM-head
# opcheck that failed there, the paired-blocks case still running at its limit), then the attention benchmark
# (decode and prefill rows; graphs replayed round-robin).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 170 python3 -m pytest -m gpu -p no:cacheprovider \
  -q -rs --tb=short "tests/backends/shared/triton/test_linear_logprob_triton.py::test_custom_ops_pass_opcheck" \
  "tests/backends/shared/triton/test_attention_triton.py::test_paired_blocks_give_the_same_rows" 2>&1 | tail -30
OUT=$OUT WORK=/tmp/w STEPS="bench_attention" DEADLINE=$(( 400 - SECONDS )) BENCH_ATTENTION_TIMEOUT=380 \
  BENCH_ATTENTION_ARGS="--kinds decode,prefill" bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-220 | tail -40
