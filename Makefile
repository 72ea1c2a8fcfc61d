# Each target does its own set-up: a .venv with pinned dependencies, and the model fetch when needed.
PY      := .venv/bin/python
STAMP   := .venv/.installed-stamp
export PYTHONUNBUFFERED := 1
# llama-cpp-python (the llama.cpp backend) is source-only on PyPI: pip compiles llama.cpp once and keeps
# the wheel in its cache. Portable x86-64 flags (AVX2 set, -march=native off): a native build on an AMX
# Xeon dies with SIGILL on batches >= 2, and a wheel cached on one machine must run on the next.
# adaptive_spec/backends/llamacpp.py holds the same string (a test keeps them equal).
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

.PHONY: setup models run test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch pinned: an unpinned torch pulls GBs of CUDA wheels on a CPU machine
	$(PY) -m pip install -q torch==2.13.0
	# every other dependency at the versions the suite last passed with (constraints.txt)
	@echo "installing the package; the first time, pip compiles llama.cpp for llama-cpp-python (about 5 min on 2 cores)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q -c constraints.txt -e ".[llama,train,eval,dev]"
	touch $@

setup: $(STAMP)

# the default pair (Qwen2.5-Coder 0.5B draft / 1.5B target) as bf16 safetensors in the cache
models: setup
	.venv/bin/adaptive-spec fetch-models

# the main job on the default pair: target alone vs fixed K vs SpecDec++ (committed head) vs the
# +2/-1 heuristic vs transformers' assisted generation, on torch and on llama.cpp; then the report
run: models
	.venv/bin/adaptive-spec sweep --config configs/sweep/quick.yaml
	.venv/bin/adaptive-spec sweep --config configs/sweep/quick_llama_cpp.yaml
	.venv/bin/adaptive-spec report --sweep-dir runs/sweep/quick --beside runs/sweep/quick_llama_cpp

# the whole test suite, the real-pair integration tests included
test: models
	$(PY) -m pytest -q

# without the real default pair (no model fetch)
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: models
	$(PY) eval/bench_decode.py --dataset humaneval --out runs/bench_decode

clean:
	rm -rf .venv .pytest_cache
