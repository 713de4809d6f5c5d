#!/usr/bin/env bash
# session 16 run 5 (nvidia-h200, .whl carried): the fused LM-head opcheck test alone in a fresh process, after it
# imports the module that registers its ops (run 4: it failed alone, the ops unregistered).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache timeout 150 python3 -m pytest -m gpu -p no:cacheprovider \
  -q -rs --tb=short "tests/backends/shared/triton/test_linear_logprob_triton.py::test_custom_ops_pass_opcheck" 2>&1 | tail -8
