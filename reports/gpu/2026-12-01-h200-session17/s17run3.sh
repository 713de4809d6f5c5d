#!/usr/bin/env bash
# session 17 run 3 (nvidia-h200, .whl carried): decode benchmark rows at batch 1 x 32768 and batch 64 x 4096 keys
# (unbuffered, so a cut run keeps its rows), then the split-merge test case run 2 did not finish.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONUNBUFFERED=1
for c in "1 32768" "64 4096"; do set -- $c
  timeout 120 python3 benchmarks/operators/bench_attention_gpu.py --out $OUT/bench_decode_b$1_c$2.json --kinds decode \
    --decode-batch $1 --decode-ctx $2 --repeats 9 2>&1 | grep -v Warn | tee $OUT/bench_decode_b$1_c$2.log \
    | grep -E "softmax |paged16 |two_launch|torch.sdpa" | cut -c1-40,100-200
done
timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q --tb=short \
  "tests/backends/shared/triton/test_attention_triton.py::test_split_merges_give_the_same_rows[bfloat16-128-4]" 2>&1 | grep -v Warn | tail -15
