# Two entry points, each sets up what it needs (see README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlk-installed

.PHONY: check test setup docs bench clean

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
	touch $(STAMP)

setup: $(STAMP)

## main job: train/rollout parity on the embedded default (tiny random Qwen3, CPU), raw bits
check: $(STAMP)
	$(BIN)/rlk check

## the whole test suite + strict docs build
test: $(STAMP)
	$(BIN)/python -m mkdocs build --strict -d site  # no -q: with -q, mkdocs 1.6 drops warnings before --strict counts them
	$(BIN)/python -m pytest -n 2 -q

bench: $(STAMP)
	$(BIN)/python benchmarks/operators/bench_cpu_ops.py --out artifacts/bench_cpu_ops.json

clean:
	rm -rf $(VENV) site artifacts .pytest_cache
