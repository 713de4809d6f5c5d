#!/usr/bin/env bash
# One GPU job for everything under backends/triton: environment, every `gpu`-marked test
# of the tree (parallel workers, then the bounded-performance smoke alone), and the GPU
# benchmarks. Logs, junit XML, the tests' evidence JSON and benchmark JSON go to $OUT.
#
#   STEPS="tests bench_attention bench_logprob bench_gemm" bash tools/benchmarking/gpu_all_run.sh
#
# Steps: tests, bench_attention, bench_moe (benchmarks/operators/bench_moe_gpu.py, BENCH_MOE_ARGS), moe_tiles
# (tools/benchmarking/moe_tiles_gpu.py: measures the MoE GEMMs' tile candidates and writes the tile table into this tree,
# so the steps after it run with it; MOE_TILES_ARGS, which must hold --commit SHA of the tree), moe_profile
# (tools/benchmarking/moe_profile_gpu.py: the MoE layer kernel by kernel, MOE_PROFILE_ARGS), moe_ncu (its rlk_moe kernels
# over one forward+backward under ncu, a CSV; MOE_NCU_ARGS, e.g. --tokens 1024), bench_attention_extra (BENCH_ATTENTION_EXTRA_ARGS), bench_attention_configs, bench_logprob, debug_logprob, bench_gemm,
# train_tiles (tools/benchmarking/attention_train_tiles_gpu.py: train-path tiles of one head dim; TRAIN_TILES_ARGS),
# gemm_tiles (tools/benchmarking/gemm_tiles_gpu.py: gemm.linear tiles at the matrix's shapes of some M; writes the
# tile table into this tree, so the steps after it run with it; GEMM_TILES_ARGS, which must hold --commit SHA),
# check_cuda (`rlk check --device cuda`: fp32 and bf16 R/R at the tiny default; bf16 R/R past the first KV
# split at Qwen3-0.6B's dimensions over contiguous and paged caches, and the P/P control at that shape, where
# native torch's prefill and decode shapes differ on a GPU (at the tiny default they may not: docs/check.md);
# CHECK_RUNS overrides), ablation
# (tools/benchmarking/attention_ablation_gpu.py), sweep (tools/benchmarking/gemm_sweep.py),
# host_overhead (tools/benchmarking/host_overhead_gpu.py; HOST_PROFILE: ';'-separated cases to cProfile), overhead (benchmarks/operators/bench_call_overhead.py),
# matrix (benchmarks/operators/bench_matrix_gpu.py, MATRIX_ARGS, default --quick), gate (the parity gate:
# tools/benchmarking/matrix_gate_gpu.py, the matrix of this tree against GATE_BASE, default .whl/base.tgz
# made by `git archive --format=tar.gz -o .whl/base.tgz BASE rl_engine`; GATE_ARGS, default --quick --modes graph;
#   GATE_ACCEPT='PATTERN=REASON': one reviewed trade the gate passes as 'accepted'; GATE_SKIP_SAME=1: no gate when
#   this tree's rl_engine equals GATE_BASE's, as after a tile step that kept the table's rows),
# matrix_ncu (tools/benchmarking/matrix_ncu.py: ncu counters of the matrix record's graph misses; MATRIX_NCU_FAMILIES,
# MATRIX_NCU_ARGS), breakdown
# (tools/benchmarking/attention_breakdown_gpu.py), e2e (benchmarks/e2e/bench_hf_qwen3.py: transformers'
# Qwen3 at 8B dimensions, plain against rl_engine installed, training step and generate; E2E_ARGS,
# E2E_TIMEOUT; needs transformers >= 5.24, and trl for E2E_ARGS=--trl: carry their wheels in .whl
# where the image's are older; the image lacks trl and datasets: carry trl, datasets, dill, multiprocess, xxhash,
# pandas, python-dateutil, six and tzdata for --trl). Two jobs can share a 2-GPU machine: give each its
# CUDA_VISIBLE_DEVICES, OUT and WORK.
#
# SHARD (attention | rest | all, default all) picks the tests step's default TESTS: a full GPU
# test run takes two device calls of 600 s (one per shard); reports/gpu/h200/gpu_tests.json
# summarises both. TESTS_TIMEOUT bounds the tests step (default 300 s; the attention shard takes
# about 330 s at 16 workers on an H200, 209 s on an H100, where 16 workers sharing 80 GB ran two fp32
# long-context tests out of memory: use XDIST=12 there); pytest itself stops SESSION_MARGIN (default 90) seconds earlier, so
# a shard cut short keeps its junit XML.
#
# Carry .whl (pydantic & deps and the Liger-Kernel wheel, missing on the device image), made once
# on the workstation for Python 3.12 manylinux x86_64:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#   python3 -m pip download --no-deps liger-kernel==0.8.5 -d .whl
# Each step has its own timeout (*_TIMEOUT, seconds) so one call of the
# device tool (600 s) can hold them; TESTS / KEXPR narrow the test run. DEADLINE (seconds from
# this script's start, default 570: under the device tool's 600 s per call; set it about 40 s under the
# call's limit when less device time is left, since the tool then cuts the call shorter) caps every step's
# limit to the time left, and the results are packed into $OUT after every step, so a job whose
# limits add up to more than the call still returns what it finished (a job killed with the call
# returns nothing).
set -uo pipefail
START=$(date +%s)
DEADLINE=${DEADLINE:-570}
# lim N: N, or the seconds left before DEADLINE (15 s kept for packing) if fewer (at least 1)
lim() { local left=$(( DEADLINE - ($(date +%s) - START) - 15 )); [ "$left" -lt 1 ] && left=1; echo $(( $1 < left ? $1 : left )); }
OUT=${OUT:-/tmp/rlk_gpu_out}
# at most 8 files come back: work in WORK, pack into OUT at the end (WORK differs per concurrent job,
# e.g. one job per GPU with CUDA_VISIBLE_DEVICES)
FINAL=$OUT; OUT=${WORK:-/tmp/rlk_gpu_work}; rm -rf "$OUT"
STEPS=${STEPS:-"tests bench_attention bench_logprob"}
mkdir -p "$OUT/evidence"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" .whl/*.whl || exit 3
  export PYTHONPATH="$PWD:$OUT/site"
else
  export PYTHONPATH="$PWD"
fi
export RLK_EVIDENCE_DIR="$OUT/evidence" TRITON_CACHE_DIR=/tmp/rlk_triton_cache
{
  echo "== env $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, pydantic, hypothesis, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'pydantic', pydantic.__version__, 'hypothesis', hypothesis.__version__, 'pytest', pytest.__version__); print(torch.cuda.get_device_name(0))"
  # what the e2e step's --trl section needs, and which of it the image lacks (carry those in .whl)
  python3 - <<'PY'
import importlib.metadata as m
def version(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return "missing"
print(" ".join(f"{p}={version(p)}" for p in ("transformers", "accelerate", "datasets", "trl", "pyarrow", "huggingface_hub")))
PY
} 2>&1 | tee "$OUT/env.txt"
# the vLLM modules are CPU tests of .venv-vllm (no vLLM on the device image): left out, or their
# module-level importorskip would read as two skips of the GPU run
# SHARD=attention / SHARD=rest: the attention kernels' GPU tests, or every other GPU test: the
# whole set takes more than one device call (over 498 s at 16 workers), so a full run is two
# calls, one per shard (TESTS, when set, wins)
case ${SHARD:-all} in
  attention) DEFAULT_TESTS="tests/backends/triton/attention" ;;
  rest) DEFAULT_TESTS="tests --ignore=tests/integrations/vllm --ignore=tests/backends/triton/attention" ;;
  all) DEFAULT_TESTS="tests --ignore=tests/integrations/vllm" ;;
  *) echo "SHARD: expected attention, rest or all, got ${SHARD}" >&2; exit 2 ;;
esac
TESTS=${TESTS:-$DEFAULT_TESTS}
# the device tool returns at most 8 files: run.log and the benchmark JSON as they are, the rest packed
pack() {
  mkdir -p "$FINAL"; cp "$OUT/run.log" "$FINAL/" 2>/dev/null; cp "$OUT"/bench_*.json "$FINAL/" 2>/dev/null
  tar -C "$OUT" --exclude=./site -czf "$FINAL/results.tgz.part" . && mv "$FINAL/results.tgz.part" "$FINAL/results.tgz"
}
for step in $STEPS; do
  t0=$(date +%s)
  case $step in
    tests)
      # pytest's own session limit (pytest-timeout >= 2.3), SESSION_MARGIN seconds (default 90) under the
      # step's: it starts no test after it and still writes the junit XML, where the hard limit below
      # would kill pytest before it writes anything (record_gpu_tests.py marks such a shard partial from this log)
      tl=$(lim ${TESTS_TIMEOUT:-300}); session=()
      # (grep reads all of the help: with -q it would stop at the match, and under pipefail the
      # help's broken pipe would fail the test)
      if python3 -m pytest --help 2>/dev/null | grep -- --session-timeout > /dev/null; then
        session=(--session-timeout $(( tl > ${SESSION_MARGIN:-90} + 30 ? tl - ${SESSION_MARGIN:-90} : tl / 2 )))
      fi
      timeout $tl python3 -m pytest $TESTS -m gpu -n ${XDIST:-8} -p no:cacheprovider -rs -v "${session[@]}" \
        --timeout $(lim ${TEST_CASE_TIMEOUT:-280}) -k "${KEXPR:-not bounded_performance}" --durations=25 --junitxml="$OUT/pytest_gpu.xml" 2>&1 \
        | grep -v -e PytestBenchmarkWarning -e 'warner(' > "$OUT/pytest_gpu.log"
      grep -E "(FAILED|ERROR|SKIPPED)" "$OUT/pytest_gpu.log" | cut -c1-200 | head -40; tail -3 "$OUT/pytest_gpu.log"
      grep -q "session-timeout: .* sec exceeded" "$OUT/pytest_gpu.log" && echo "PARTIAL: pytest's session limit (${session[*]}) ended the shard"
      timeout $(lim ${PERF_TIMEOUT:-120}) python3 -m pytest $TESTS -m gpu -n 0 -p no:cacheprovider -rs -k bounded_performance \
        --junitxml="$OUT/pytest_gpu_perf.xml" 2>&1 | grep -v -e PytestBenchmarkWarning -e 'warner(' > "$OUT/pytest_gpu_perf.log"
      tail -3 "$OUT/pytest_gpu_perf.log" ;;
    bench_attention)
      timeout $(lim ${BENCH_ATTENTION_TIMEOUT:-150}) python3 benchmarks/operators/bench_attention_gpu.py --out "$OUT/bench_attention_gpu.json" \
        ${BENCH_ATTENTION_ARGS:-} > "$OUT/bench_attention_gpu.log" 2>&1; tail -25 "$OUT/bench_attention_gpu.log" ;;
    bench_attention_extra)  # a second attention benchmark invocation (BENCH_ATTENTION_EXTRA_ARGS, e.g. other decode batches)
      timeout $(lim ${BENCH_ATTENTION_EXTRA_TIMEOUT:-150}) python3 benchmarks/operators/bench_attention_gpu.py \
        --out "$OUT/bench_attention_extra.json" ${BENCH_ATTENTION_EXTRA_ARGS:-} > "$OUT/bench_attention_extra.log" 2>&1
      tail -60 "$OUT/bench_attention_extra.log" ;;
    bench_logprob)
      timeout $(lim ${BENCH_LOGPROB_TIMEOUT:-150}) python3 benchmarks/operators/bench_linear_logprob_gpu.py --out "$OUT/bench_linear_logprob_gpu.json" \
        ${BENCH_LOGPROB_ARGS:-} > "$OUT/bench_linear_logprob_gpu.log" 2>&1; tail -25 "$OUT/bench_linear_logprob_gpu.log" ;;
    debug_logprob)
      timeout $(lim ${DEBUG_LOGPROB_TIMEOUT:-120}) python3 tools/benchmarking/debug_linear_logprob_gpu.py --out "$OUT/debug_linear_logprob.json" \
        > "$OUT/debug_linear_logprob.log" 2>&1; tail -40 "$OUT/debug_linear_logprob.log" ;;
    bench_attention_configs)
      timeout $(lim ${BENCH_ATTENTION_CONFIGS_TIMEOUT:-150}) python3 benchmarks/operators/bench_attention_gpu.py --configs all \
        --out "$OUT/bench_attention_configs.json" ${BENCH_ATTENTION_CONFIGS_ARGS:-} > "$OUT/bench_attention_configs.log" 2>&1
      tail -40 "$OUT/bench_attention_configs.log" ;;
    check_cuda)  # the main job end to end on the GPU: rl-kernel train vs rollout log-probs, then the native control
      # the last three: past the first 1024-key KV split at Qwen3-0.6B's dimensions (split-parallel
      # decode), contiguous and paged rollout caches, and the P/P control at that shape; CHECK_RUNS
      # (';'-separated argument sets) overrides
      IFS=';' read -ra check_runs <<< "${CHECK_RUNS:---dtype float32;--dtype bfloat16;--dtype bfloat16 --preset qwen3-0.6b --extra-prompt-tokens 1000;--dtype bfloat16 --preset qwen3-0.6b --extra-prompt-tokens 1000 --plan P/P;--dtype bfloat16 --preset qwen3-0.6b --extra-prompt-tokens 1000 --kv-cache paged}"
      for args in "${check_runs[@]}"; do
        echo "-- rlk check --device cuda $args"
        timeout $(lim ${CHECK_TIMEOUT:-120}) python3 -c 'import sys; from rl_engine.entrypoints.cli import main; sys.exit(main())' check --device cuda $args --json \
          > "$OUT/check_cuda_$(echo $args | tr -c 'a-zA-Z0-9' _).json" 2>> "$OUT/check_cuda.err"; echo "rc=$?"
        tail -c 600 "$OUT/check_cuda_$(echo $args | tr -c 'a-zA-Z0-9' _).json"; echo
      done; tail -5 "$OUT/check_cuda.err" ;;
    ablation)
      timeout $(lim ${ABLATION_TIMEOUT:-150}) python3 tools/benchmarking/attention_ablation_gpu.py --out "$OUT/bench_attention_ablation.json" \
        ${ABLATION_ARGS:-} > "$OUT/attention_ablation.log" 2>&1; cut -c1-220 "$OUT/attention_ablation.log" | tail -40 ;;
    sweep)  # gemm tile sweep (tools/benchmarking/gemm_sweep.py); SWEEP_ARGS / SWEEP2_ARGS: one or two invocations
      timeout $(lim ${SWEEP_TIMEOUT:-200}) python3 tools/benchmarking/gemm_sweep.py --out "$OUT/bench_gemm_sweep.json" ${SWEEP_ARGS:-} \
        > "$OUT/gemm_sweep.log" 2>&1; grep -E "BEST|BITS|bits part|error|Error" "$OUT/gemm_sweep.log" | cut -c1-200 | tail -30
      if [ -n "${SWEEP2_ARGS:-}" ]; then
        timeout $(lim ${SWEEP2_TIMEOUT:-200}) python3 tools/benchmarking/gemm_sweep.py --out "$OUT/gemm_sweep2.json" $SWEEP2_ARGS \
          > "$OUT/gemm_sweep2.log" 2>&1; grep -E "BEST|error|Error" "$OUT/gemm_sweep2.log" | cut -c1-300 | tail -30
      fi ;;
    gemm_tiles)  # measure gemm.linear tiles at the matrix's shapes of some M; writes the tile table into this tree (later steps use it) and $OUT
      timeout $(lim ${GEMM_TILES_TIMEOUT:-240}) python3 tools/benchmarking/gemm_tiles_gpu.py --out "$OUT/bench_gemm_tiles.json" \
        --max-seconds $(( $(lim ${GEMM_TILES_TIMEOUT:-240}) - 20 )) ${GEMM_TILES_ARGS:-} > "$OUT/gemm_tiles.log" 2>&1
      echo "rc=$?"; grep -E "^M=[0-9]+:|precompiled|wrote|stopped|Error" "$OUT/gemm_tiles.log" | cut -c1-300 | tail -20
      cp rl_engine/backends/triton/gemm/tile_tables/*.json "$OUT/" 2>/dev/null ;;
    train_tiles)  # train-path tiles of one head dim, bits and time beside SDPA (tools/benchmarking/attention_train_tiles_gpu.py)
      timeout $(lim ${TRAIN_TILES_TIMEOUT:-180}) python3 tools/benchmarking/attention_train_tiles_gpu.py \
        --out "$OUT/bench_attention_train_tiles.json" ${TRAIN_TILES_ARGS:-} > "$OUT/attention_train_tiles.log" 2>&1
      echo "rc=$?"; tail -30 "$OUT/attention_train_tiles.log" | cut -c1-240 ;;
    breakdown)  # per-kernel device time of each attention launcher (tools/benchmarking/attention_breakdown_gpu.py)
      timeout $(lim ${BREAKDOWN_TIMEOUT:-120}) python3 tools/benchmarking/attention_breakdown_gpu.py --out "$OUT/bench_attention_breakdown.json" \
        > "$OUT/attention_breakdown.log" 2>&1; cut -c1-200 "$OUT/attention_breakdown.log" | tail -60 ;;
    host_overhead)  # host time per eager call, where it goes (tools/benchmarking/host_overhead_gpu.py)
      # HOST_PROFILE: ';'-separated case names to cProfile (they contain spaces), e.g. "kernels;rms_norm public"
      prof=(); if [ -n "${HOST_PROFILE:-}" ]; then IFS=';' read -ra cases <<< "$HOST_PROFILE"; prof=(--profile "${cases[@]}"); fi
      timeout $(lim ${HOST_TIMEOUT:-90}) python3 tools/benchmarking/host_overhead_gpu.py --out "$OUT/bench_host_overhead.json" \
        "${prof[@]}" > "$OUT/host_overhead.log" 2>&1; grep -v "^ " "$OUT/host_overhead.log" | head -60 ;;
    overhead)  # host cost per small call through the public API (benchmarks/operators/bench_call_overhead.py)
      timeout $(lim ${OVERHEAD_TIMEOUT:-120}) python3 benchmarks/operators/bench_call_overhead.py --device cuda \
        --out "$OUT/bench_call_overhead.json" ${OVERHEAD_ARGS:-} > "$OUT/bench_call_overhead.log" 2>&1
      tail -12 "$OUT/bench_call_overhead.log" ;;
    matrix)  # the public-API matrix; --max-seconds ends it cleanly (the report keeps the finished points)
      maxs=$(( $(lim ${MATRIX_TIMEOUT:-300}) - 30 )); [ "$maxs" -lt 1 ] && maxs=1
      timeout $(lim ${MATRIX_TIMEOUT:-300}) python3 benchmarks/operators/bench_matrix_gpu.py --out "$OUT/bench_matrix_gpu.json" \
        --max-seconds $maxs ${MATRIX_ARGS:---quick} > "$OUT/bench_matrix_gpu.log" 2>&1
      grep -E "MISSED|targets met|stopped|error" "$OUT/bench_matrix_gpu.log" | cut -c1-220 | tail -60 ;;
    gate)  # parity gate: fails when a point is > 5 % slower than GATE_BASE or its bits differ (runs alternate)
      # GATE_SKIP_SAME=1: no gate when this tree's rl_engine is GATE_BASE's (a tile step that kept its rows)
      same=0
      if [ "${GATE_SKIP_SAME:-0}" = 1 ] && [ -f "${GATE_BASE:-.whl/base.tgz}" ]; then
        rm -rf /tmp/rlk_gate_same && mkdir -p /tmp/rlk_gate_same && tar -C /tmp/rlk_gate_same -xzf "${GATE_BASE:-.whl/base.tgz}" \
          && diff -rq -x __pycache__ /tmp/rlk_gate_same/rl_engine rl_engine > /dev/null && same=1
      fi
      if [ "$same" = 1 ]; then
        echo "gate skipped: rl_engine is the baseline's (GATE_SKIP_SAME=1)"
      else
        gl=$(lim ${GATE_TIMEOUT:-540})
        timeout $gl python3 tools/benchmarking/matrix_gate_gpu.py --base base=${GATE_BASE:-.whl/base.tgz} --new new=. \
          --rounds ${GATE_ROUNDS:-2} --out-dir "$OUT/gate" --work /tmp/rlk_gate_trees --deadline $(( gl > 20 ? gl - 10 : gl )) \
          ${GATE_ACCEPT:+--accept "$GATE_ACCEPT"} -- ${GATE_ARGS:---quick --modes graph} > "$OUT/matrix_gate.log" 2>&1
        echo "gate rc=$?"
        cp "$OUT/gate/matrix_gate.json" "$OUT/bench_matrix_gate.json" 2>/dev/null; tail -80 "$OUT/matrix_gate.log" | cut -c1-240
      fi ;;
    e2e)  # end to end through transformers; the report is rewritten after each section: a time limit keeps what finished
      timeout $(lim ${E2E_TIMEOUT:-540}) python3 benchmarks/e2e/bench_hf_qwen3.py --out "$OUT/bench_hf_qwen3.json" \
        ${E2E_ARGS:-} > "$OUT/bench_hf_qwen3.log" 2>&1; echo "rc=$?"; grep -v -i warn "$OUT/bench_hf_qwen3.log" | tail -40 ;;
    bench_moe)  # the routed-expert layer at Qwen3-30B-A3B's dimensions against torch._grouped_mm (benchmarks/operators/bench_moe_gpu.py)
      timeout $(lim ${BENCH_MOE_TIMEOUT:-150}) python3 benchmarks/operators/bench_moe_gpu.py --out "$OUT/bench_moe_gpu.json" \
        ${BENCH_MOE_ARGS:-} > "$OUT/bench_moe_gpu.log" 2>&1; echo "rc=$?"; tail -40 "$OUT/bench_moe_gpu.log" | cut -c1-220 ;;
    moe_tiles)  # measure the MoE GEMMs' tile candidates; writes the tile table into this tree (later steps use it) and $OUT
      timeout $(lim ${MOE_TILES_TIMEOUT:-240}) python3 tools/benchmarking/moe_tiles_gpu.py --out "$OUT/bench_moe_tiles.json" \
        ${MOE_TILES_ARGS:-} > "$OUT/moe_tiles.log" 2>&1; echo "rc=$?"; tail -50 "$OUT/moe_tiles.log" | cut -c1-220
      cp rl_engine/backends/triton/moe/tile_tables/*.json "$OUT/" 2>/dev/null ;;
    moe_profile)  # the MoE layer kernel by kernel: device time, wall time, GEMM TFLOP/s, ours and torch._grouped_mm (tools/benchmarking/moe_profile_gpu.py)
      timeout $(lim ${MOE_PROFILE_TIMEOUT:-120}) python3 tools/benchmarking/moe_profile_gpu.py --out "$OUT/bench_moe_profile.json" \
        ${MOE_PROFILE_ARGS:-} > "$OUT/moe_profile.log" 2>&1; echo "rc=$?"; tail -60 "$OUT/moe_profile.log" | cut -c1-220 ;;
    matrix_ncu)  # Nsight Compute counters of a matrix record's graph-mode misses, ours and each baseline, one ncu run per
      # family so a time limit keeps the families finished (tools/benchmarking/matrix_ncu.py; MATRIX_NCU_ARGS, e.g. --record R --within "*M=256";
      # --kernels REGEX profiles only the kernels it matches: ncu fails on cuDNN's fused SDPA kernel and then writes nothing)
      for fam in ${MATRIX_NCU_FAMILIES:-gemm attention decode}; do
        ncu_cmd=$(python3 tools/benchmarking/matrix_ncu.py --command --families "$fam" ${MATRIX_NCU_ARGS:-}) || continue
        PATH="$PATH:/usr/local/cuda/bin" timeout $(lim ${MATRIX_NCU_TIMEOUT:-200}) bash -c "exec $ncu_cmd" \
          > "$OUT/matrix_ncu_$fam.csv" 2> "$OUT/matrix_ncu_$fam.log"
        echo "$fam rc=$?"; grep -h "==ERROR==" "$OUT/matrix_ncu_$fam".* | head -5; tail -4 "$OUT/matrix_ncu_$fam.log" | cut -c1-220
      done
      parts=(); for fam in ${MATRIX_NCU_FAMILIES:-gemm attention decode}; do
        [ -s "$OUT/matrix_ncu_$fam.csv" ] && parts+=("$fam=$OUT/matrix_ncu_$fam.csv"); done
      python3 tools/benchmarking/matrix_ncu.py --summary "${parts[@]}" --out "$OUT/matrix_ncu.json" | cut -c1-300 | head -150 ;;
    moe_ncu)  # Nsight Compute counters of the rlk_moe kernels over one forward+backward (moe_profile_gpu.py --single, 16,384 tokens)
      ncu_cmd=$(python3 tools/benchmarking/moe_profile_gpu.py --ncu-command ${MOE_NCU_ARGS:-}) && echo "$ncu_cmd" | cut -c1-220 \
        && PATH="$PATH:/usr/local/cuda/bin" timeout $(lim ${MOE_NCU_TIMEOUT:-200}) bash -c "exec $ncu_cmd" > "$OUT/moe_ncu.csv" 2> "$OUT/moe_ncu.log"
      echo "rc=$?"; head -5 "$OUT/moe_ncu.csv" | cut -c1-220; grep -h "==ERROR==" "$OUT"/moe_ncu.* | head -5
      tail -12 "$OUT/moe_ncu.log" | cut -c1-220
      python3 tools/benchmarking/moe_profile_gpu.py --ncu-summary "$OUT/moe_ncu.csv" | cut -c1-220 | head -100 ;;
    bench_gemm)
      timeout $(lim ${BENCH_GEMM_TIMEOUT:-150}) python3 benchmarks/operators/bench_gemm_gpu.py --out "$OUT/bench_gemm_gpu.json" \
        ${BENCH_GEMM_ARGS:-} > "$OUT/bench_gemm_gpu.log" 2>&1; tail -32 "$OUT/bench_gemm_gpu.log" ;;
  esac
  echo "== step $step took $(( $(date +%s) - t0 )) s"
  pack
done 2>&1 | tee "$OUT/run.log"
pack; ls -la "$FINAL"
