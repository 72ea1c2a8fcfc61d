# Each target does its own set-up: a .venv with pinned dependencies, and the model fetch when needed.
PY      := .venv/bin/python
STAMP   := .venv/.installed-stamp
export PYTHONUNBUFFERED := 1
# llama-cpp-python (the llama.cpp backend) is source-only on PyPI: llama.cpp is compiled once per
# kind of CPU, with the instruction sets named from /proc/cpuinfo and AMX off (a -march=native build
# can die with SIGILL on a CPU with AMX), and the wheel is kept under a name listing them
# (adaptive_spec/setup/llama_build.py says why; `python3 adaptive_spec/setup/llama_build.py`
# prints this CPU's flags).
LLAMA_TIER := $(shell python3 adaptive_spec/setup/llama_build.py tier 2>/dev/null)

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
	$(PY) adaptive_spec/setup/llama_build.py install -c constraints.txt
	touch $@

setup: $(STAMP) $(LLAMA_STAMP)

# the default pair (Qwen2.5-Coder 0.5B draft / 1.5B target) as bf16 safetensors in the cache
models: setup
	.venv/bin/adaptive-spec fetch-models

# $(call phase,NAME,COMMAND): run COMMAND as one timed phase of `make run`; its seconds go to $(PHASES)
PHASES := runs/make_run_phases.tsv
phase = echo "== $(1)"; start=$$(date +%s); $(2) || exit $$?; \
	printf '%s\t%s\n' "$(1)" $$(( $$(date +%s) - start )) >> $(PHASES)
# the torch half sized to the CPU: where torch has no bf16 kernels (AVX2) the target runs in fp32, streaming
# twice the bytes a step, and the half takes one prompt (the rule is cpu.auto_dtype's, asked of the package)
TORCH_SIZE = $$(.venv/bin/python -c "from adaptive_spec.backends.cpu.machine import native_bf16; print('' if native_bf16() else 'n_prompts=1')")

# the main job on the default pair, timed phase by phase (the breakdown prints at the end): set-up, the
# fetch, then on llama.cpp the target alone vs fixed K vs SpecDec++ (committed head, h = auto) vs prompt
# lookup vs both combined, on torch the target alone vs fixed K vs SpecDec++ vs transformers' assisted
# generation, and the report (runs/sweep/quick_llama_cpp/report.md, what won and why in words at its top).
# llama.cpp's first build is the one long part: it says how long it takes while it compiles, and a rerun
# (or another checkout on the same kind of CPU) skips it
run:
	@mkdir -p runs && rm -f $(PHASES)
	@$(call phase,packages,$(MAKE) --no-print-directory $(STAMP))
	@$(call phase,llama.cpp build (once per CPU kind),$(MAKE) --no-print-directory $(LLAMA_STAMP))
	@$(call phase,fetch the pair,.venv/bin/adaptive-spec fetch-models)
	@$(call phase,llama.cpp half,.venv/bin/adaptive-spec sweep --config configs/sweep/quick_llama_cpp.yaml)
	@$(call phase,torch half,.venv/bin/adaptive-spec sweep --config configs/sweep/quick.yaml $(TORCH_SIZE))
	@$(call phase,report,.venv/bin/adaptive-spec report --sweep-dir runs/sweep/quick_llama_cpp --beside runs/sweep/quick)
	@echo "== make run, phase by phase (m:ss)"
	@awk -F'\t' '{ printf "  %-36s %3d:%02d\n", $$1, $$2 / 60, $$2 % 60; t += $$2; if ($$1 ~ /once/) b += $$2 } \
		END { printf "  %-36s %3d:%02d\n  %-36s %3d:%02d\n", "total", t / 60, t % 60, \
		"total without the one-time build", (t - b) / 60, (t - b) % 60 }' $(PHASES)
	@echo "what pays on this machine for other files or heads: .venv/bin/adaptive-spec probe --help"

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

# the one prepared GPU check (eval/gpu_check.py, docs/gpu.md): one report under $OUT (else runs/gpu_check)
# in at most 8 minutes. On a GPU machine without the .venv (python3 with torch, no pydantic) the wheels
# carried in .whl/ (`python eval/gpu_check.py --fetch-wheels` where pip works) are installed into /tmp/site first
GPU_PY := $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
.PHONY: gpu-check
gpu-check:
	@site=; if ! $(GPU_PY) -c "import pydantic" 2>/dev/null; then test -d .whl || { echo "error: pydantic is \
	missing and there is no .whl/: run python eval/gpu_check.py --fetch-wheels where pip works, and carry .whl"; \
	exit 2; }; $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	--target /tmp/site .whl/*.whl && site=/tmp/site:; fi; \
	PYTHONPATH=$$site. $(GPU_PY) eval/gpu_check.py $(GPU_CHECK_ARGS)
