#!/usr/bin/env bash
# session 23 run 5 (nvidia-h200, .whl carried): the attention tests that run 4's rerun step (120 s)
# did not reach: the decode TMA test at D = 128 (now with the transposed kernel off) and the
# paired-blocks tests (forced configs: no Hopper decode kernel takes their steps).
W0=/tmp/w0; rm -rf $W0; mkdir -p $W0/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W0/site .whl/*.whl || exit 3
PYTHONPATH="$PWD:$W0/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 170 python3 -m pytest \
  tests/backends/shared/triton/test_attention_triton.py -m gpu -p no:cacheprovider -rs -v -n 4 \
  -k "test_decode_tma_loads_give_the_same_rows or test_paired_blocks_give_the_same_rows" \
  > $OUT/pytest_attention_rerun2.log 2>&1
echo "rc=$?"; grep -E "PASSED|FAILED|passed|failed" $OUT/pytest_attention_rerun2.log | cut -c1-200 | tail -12
