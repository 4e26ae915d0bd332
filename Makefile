# `make test` and `make serve` work from a fresh clone: they create .venv with Python 3.12
# (pinned in .python-version, found through pyenv when it is not the default python3).
PYTHON_VERSION := $(shell cat .python-version)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve bench clean

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

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15 tests

serve: $(STAMP)
	$(PY) -m k3jax.serve

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) build *.egg-info
