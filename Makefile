# Each target does its own set-up: a .venv with pinned dependencies, and the model fetch when needed.
PY      := .venv/bin/python
STAMP   := .venv/.installed-stamp
export PYTHONUNBUFFERED := 1
# llama-cpp-python (the llama.cpp backend) is source-only on PyPI: llama.cpp is compiled once per
# kind of CPU, with the instruction sets named from /proc/cpuinfo and AMX off (a -march=native build
# dies with SIGILL on an AMX Xeon), and the wheel is kept under a name listing them
# (adaptive_spec/backends/llama_build.py says why; `python3 adaptive_spec/backends/llama_build.py`
# prints this CPU's flags).
LLAMA_TIER := $(shell python3 adaptive_spec/backends/llama_build.py tier 2>/dev/null)

.PHONY: setup models run test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch pinned: an unpinned torch pulls GBs of CUDA wheels on a CPU machine
	$(PY) -m pip install -q torch==2.13.0
	# every other dependency at the versions the suite last passed with (constraints.txt)
	$(PY) -m pip install -q -c constraints.txt -e ".[train,eval,dev]"
	touch $@

# the binding, built for this CPU's instruction sets (once per kind of CPU; a rerun on the same kind
# installs nothing): a .venv or a cache carried to another CPU gets a build that runs there
LLAMA_STAMP := .venv/.llama-cpp-python-0.3.36-$(LLAMA_TIER)
$(LLAMA_STAMP): $(STAMP)
	$(PY) adaptive_spec/backends/llama_build.py install -c constraints.txt
	touch $@

setup: $(STAMP) $(LLAMA_STAMP)

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

# the decode benchmark: the target alone against fixed K per draft configuration (a sweep with a drafts axis)
bench: models
	.venv/bin/adaptive-spec sweep --config configs/sweep/bench.yaml
	.venv/bin/adaptive-spec report --sweep-dir runs/sweep/bench

clean:
	rm -rf .venv .pytest_cache
