#!/usr/bin/env bash
# session 19 run 7 (nvidia-h200, .whl carried): the two programmatic-dependent-launch GPU tests
# after their negative-control loop moved into one helper (_assert_pdl_race_caught).
set -uo pipefail
W=/tmp/w; rm -rf $W; mkdir -p $W/site $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/rlk_triton_cache PYTHONPATH="$PWD:$W/site"
timeout 170 python3 -m pytest tests/backends/shared/triton/test_attention_triton.py -m gpu -n 2 -p no:cacheprovider -rs -q \
  -k "programmatic_dependent_launch" --timeout 160 > $OUT/pytest_gpu.log 2>&1
echo "tests rc=$?"; grep -E "FAILED|ERROR|SKIPPED" $OUT/pytest_gpu.log | head; tail -2 $OUT/pytest_gpu.log
