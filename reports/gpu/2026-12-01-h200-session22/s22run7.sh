#!/usr/bin/env bash
# session 22 run 7 (nvidia-h200, .whl carried): the PDL tests with the negative control's race given
# 20 tries (run 5: five passed uncaught once under the 16-process shard), beside the warpgroup tests
# and the decode tests (-n 8, the GPU shared as in the shard).
set -uo pipefail
W=/tmp/w; rm -rf $W; mkdir -p $W/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
PYTHONPATH="$PWD:$W/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 240 python3 -m pytest \
  tests/backends/shared/triton/test_attention_triton.py -m gpu -n 8 -p no:cacheprovider -rs \
  -k "programmatic_dependent_launch or warpgroup or split_grid or decode_tma" > $OUT/pytest_pdl.log 2>&1
echo "rc=$?"; grep -E "FAILED|passed|failed" $OUT/pytest_pdl.log | cut -c1-200
