# Two commands from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# Installed only when the venv has no importable torch, so a machine never pulls a
# second multi-GB build. Override for CUDA, e.g. TORCH_SPEC="torch==2.13.0 --index-url ...".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip -q --disable-pip-version-check

.PHONY: demo test bench soak clean redis-server

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_SPEC)
	touch $@

$(VENV)/.runtime: pyproject.toml setup.py $(VENV)/.torch
	$(PIP) install -e ".[bench]"
	touch $@

$(VENV)/.dev: pyproject.toml setup.py $(VENV)/.torch
	$(PIP) install -e ".[dev,bench]"
	touch $@ $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(BIN)/pdserve demo

# The packages that start Ray run in pytest processes of their own. Ray 2.60 leaves its
# core worker's io thread ("worker.io") running after ray.shutdown() once a streaming
# generator was used (the router's step streams are), and CI's pytest process aborted
# (abseil mutex.cc, no traceback) in tests that ran after them. Nothing runs after
# the last Ray session in a process this way, and no second Ray session follows one.
RAY_TESTS := tests/cluster tests/multinode tests/autoscaler

# The tests of several routers over Redis run a real redis-server (Debian's package).
REDIS_SERVER := $(shell command -v redis-server 2>/dev/null)

redis-server:
ifeq ($(REDIS_SERVER),)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null || \
		(apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null); \
	else \
		echo "make test needs redis-server: install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis)"; \
		exit 1; \
	fi
endif

test: $(VENV)/.dev redis-server
	$(BIN)/python -m pytest -q --durations=15 $(addprefix --ignore=,$(RAY_TESTS))
	$(foreach t,$(RAY_TESTS),$(BIN)/python -m pytest -q --durations=15 $(t) &&) true

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/engine_throughput.py
	$(BIN)/python benchmarks/kv_transfer.py
	$(BIN)/python benchmarks/serving_overhead.py
	$(BIN)/python benchmarks/router_responsiveness.py
	$(BIN)/python benchmarks/decide.py
	$(BIN)/python benchmarks/routing.py
	$(BIN)/python benchmarks/replicas.py
	$(BIN)/python benchmarks/migration.py

# one hour of steady load: RSS, threads and fds of every process, and their slopes
soak: $(VENV)/.dev
	$(BIN)/python benchmarks/soak.py

clean:
	rm -rf $(VENV) build *.egg-info
