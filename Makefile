# Two entry points: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# CPU build from local disk; a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# A whole local cluster (etcd, router, 1 prefill + 1 decode node on a tiny random model),
# one real request through it, then a clean stop.
run: $(STAMP)
	$(VENV)/bin/pdcluster up --smoke --port 0

test: $(STAMP)
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
