# `make test` and `make serve` work from a fresh clone: they create .venv with Python 3.12
# (pinned in .python-version, found through pyenv when it is not the default python3).
PYTHON_VERSION := $(shell cat .python-version)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve bench weights clean

# benchmarks/compare_transformers.py's reference side (torch + transformers) lives in its own venv inside
# .venv: the CPU torch wheel at hand (torch 2.13.0+cpu) is built for CPython 3.11 only; PyPI's Linux torch
# is the CUDA build. Elsewhere: make bench TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_PYTHON_VERSION ?= 3.11
TORCH_INDEX ?=
TORCH_PY := $(VENV)/torch/bin/python
# make bench ONLY=compare_transformers (a comma-separated list; python -m benchmarks.run_all --list)
ONLY ?=

$(PY):
	@if command -v pyenv >/dev/null 2>&1 && pyenv versions --bare | grep -qx "$(PYTHON_VERSION)"; then \
		PYENV_VERSION=$(PYTHON_VERSION) pyenv exec python -m venv $(VENV); \
	elif command -v python3.12 >/dev/null 2>&1; then \
		python3.12 -m venv $(VENV); \
	else \
		echo "k3jax needs Python 3.12 (pyenv $(PYTHON_VERSION) or python3.12 on PATH)"; exit 1; \
	fi

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test,serve]'
	@touch $(STAMP)

# The modules that compare numeric paths (tests/agreement.py) run a second time with XLA:CPU's code
# limited to AVX2: another instruction set rounds otherwise, and an assertion that holds only on the
# machine that wrote it fails here rather than on the next machine (issue 19). Tests marked
# isa_invariant (bookkeeping, compile counts, errors) run once, and so do those marked isa_covered (another
# test of the pass runs the same paths).
ISA_TESTS := tests/test_agreement.py tests/k3jax/test_model.py tests/k3jax/test_paged_decode.py \
	tests/k3jax/test_speculative_forward.py tests/k3jax/test_ffn.py tests/serve/test_engine.py \
	tests/serve/dspark/test_engine_dspark.py tests/serve/dspark/test_engine_speculative.py \
	tests/sharding/test_sharding.py tests/eval/test_eval_job.py tests/convert/test_kimi_linear_oracle.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15 tests
	XLA_FLAGS=--xla_cpu_max_isa=AVX2 $(PY) -m pytest -q -n 2 --durations=5 -m "not isa_invariant and not isa_covered" $(ISA_TESTS)

serve: $(STAMP)
	$(PY) -m k3jax.serve

# The embedded k3-tiny that LLM() and make serve load (k3jax/weights/k3-tiny): trained in JAX on
# pydoc_data.topics in K3's chat format, then its tiny vision tower against the frozen text model,
# deterministic given the seed (k3jax/train/; about 25 + 10 minutes on 2 cores). The tower exercises
# the image path but does not see: held-out captions at chance (no reply of 100 names a colour; chance 0.25).
weights: $(STAMP)
	$(PY) -m k3jax.train

$(TORCH_PY): | $(PY)
	@v=$$(command -v pyenv >/dev/null 2>&1 && pyenv versions --bare | grep -E '^$(subst .,\.,$(TORCH_PYTHON_VERSION))(\.|$$)' | tail -1); \
	if [ -n "$$v" ]; then PYENV_VERSION=$$v pyenv exec python -m venv $(VENV)/torch; \
	elif command -v python$(TORCH_PYTHON_VERSION) >/dev/null 2>&1; then python$(TORCH_PYTHON_VERSION) -m venv $(VENV)/torch; \
	else echo "the transformers side of make bench needs Python $(TORCH_PYTHON_VERSION) (TORCH_PYTHON_VERSION=...)"; exit 1; fi
	$(TORCH_PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(TORCH_PY) -m pip install -q transformers==5.23.0 safetensors numpy

# the torch side is built only for a run that includes compare_transformers (all of them, or named)
bench: $(STAMP) $(if $(ONLY),$(if $(findstring compare_transformers,$(ONLY)),$(TORCH_PY)),$(TORCH_PY))
	K3JAX_TORCH_PYTHON=$(TORCH_PY) $(PY) -m benchmarks.run_all $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf $(VENV) build *.egg-info
