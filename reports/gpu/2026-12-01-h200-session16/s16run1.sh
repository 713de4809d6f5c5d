#!/usr/bin/env bash
# session 16 run 1 (nvidia-h200, .whl carried): four key blocks a step (AttnConfig.unroll = 4, rlk_attn_quad);
# the decode probe (bits against the shipped step + round-robin timing with SDPA) over batch-1 and batch-4
# steps, then the GPU tests that compare unrolled / sliced / every shipped configuration raw-bit.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/site" TRITON_CACHE_DIR=/tmp/rlk_triton_cache
timeout 330 python3 tools/benchmarking/attention_decode_gpu.py --out $OUT/decode_probe.json \
  --cases 1x4096,1x512,1x32768,4x4096 \
  --configs m16_w4_s3_v4_u2,m16_w4_s3_v4_u4,m16_w4_s3_v2_u4,m16_w4_s2_v1_u4,m16_w8_s3_v4_u4,m16_w2_s2_v4_u4 2>&1 \
  | grep -v Warning | tail -90
echo "probe rc=$?"
OUT=$OUT WORK=/tmp/w STEPS="tests" XDIST=16 DEADLINE=$(( 585 - SECONDS )) \
  TESTS="tests/backends/shared/triton/test_attention_triton.py" KEXPR="paired or shipped_config or value_slices or decode_tma" \
  TESTS_TIMEOUT=240 TEST_CASE_TIMEOUT=230 \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | grep -v '^ ' | cut -c1-200 \
  | grep -E "passed|failed|FAILED|ERROR|SKIPPED|rc=|step|Error" | tail -20
