# Colibri: `make run` serves the trained default model, `make test` runs the test suite; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TINY_MODEL ?= .colibri/tiny-mixtral
DEFAULT_MODEL ?= .colibri/default-model
DEFAULT_MODEL_HF := training/default-model-hf
# With an NVIDIA GPU visible, the cuda extra (numba-cuda and its CUDA 13 wheels) comes too.
comma := ,
EXTRAS := dev$(if $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null),$(comma)cuda)
PROTOS := $(shell find protos -name '*.proto')
PB := $(patsubst protos/%.proto,common/pb/%_pb2.py,$(PROTOS))
CHECKOV_VENV ?= .venv-checkov
# buf (protobuf lint and breaking-change checks), pinned, installed from npm into .buf/ (git-ignored).
BUF_VERSION := 1.75.0
BUF_DIR := .buf
BUF := $(BUF_DIR)/node_modules/.bin/buf
BUF_STAMP := $(BUF_DIR)/.installed-$(BUF_VERSION)
# The released API that `buf breaking` compares protos/ against; `make proto-baseline` refreshes it.
API_BASELINE := protos/api.binpb

.PHONY: run tiny test test-gpu proto install install-test lint lint-size lint-proto proto-baseline clean

# Runtime dependencies + the package (editable) in .venv.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

# Test extra: torch (CPU) + transformers for parity, numba-cuda for sm_90 compile checks.
$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# checkov (the policy check of deploy/k8s in tests/deploy) in a venv of its own: its pins (networkx<2.7,
# packaging<24) conflict with the test extra's torch and transformers.
$(CHECKOV_VENV)/bin/checkov:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet 'checkov==3.3.30'

# gRPC stubs (and .pyi type stubs) from protos/ into common/pb/colibri/<service>/v1/, re-exported by
# common/pb/__init__.py (`from common.pb import router_pb2`), by setup.py's generate_stubs (pip runs it too).
# Stubs of the old flat layout are removed: loaded next to the new ones they would define the messages twice.
$(PB): $(PROTOS) setup.py $(BIN)/.installed
	rm -f common/pb/*_pb2*.py common/pb/*_pb2*.pyi
	$(BIN)/python -c 'import setup; setup.generate_stubs()'
proto: $(PB)

# The binary comes as the platform's optional dependency (@bufbuild/buf-linux-x64, ...); the package's install
# script, skipped here, only checks it or fetches it again.
$(BUF_STAMP):
	npm install --prefix $(BUF_DIR) --no-save --ignore-scripts --no-audit --no-fund --loglevel=error \
		@bufbuild/buf@$(BUF_VERSION)
	touch $@

# The gRPC contract (docs/api.md): buf's STANDARD lint, and no breaking change against the committed baseline.
lint-proto: $(BUF_STAMP)
	$(BUF) lint protos
	$(BUF) breaking protos --against $(API_BASELINE)

# Makes the protos as they are the baseline: run it, and commit protos/api.binpb, when a deliberate API change is
# released (a break shows up in review as a changed baseline).
proto-baseline: $(BUF_STAMP)
	$(BUF) build protos --exclude-source-info -o $(API_BASELINE)

install: $(BIN)/.installed $(PB)

# The default model: a small Mixtral trained on the World English Bible (docs/default-model.md), converted.
$(DEFAULT_MODEL)/colibri.json: $(DEFAULT_MODEL_HF)/model.safetensors $(DEFAULT_MODEL_HF)/config.json $(DEFAULT_MODEL_HF)/tokenizer.json $(DEFAULT_MODEL_HF)/chat_template.jinja | install
	$(BIN)/colibri convert $(DEFAULT_MODEL_HF) $(DEFAULT_MODEL) --dtype bfloat16

# A deterministic random-weight test model with a byte-level tokenizer (`make tiny`).
$(TINY_MODEL)/colibri.json: | install
	$(BIN)/colibri make-tiny $(TINY_MODEL)
tiny: $(TINY_MODEL)/colibri.json

# Serve the default model (or MODEL=DIR) through both gRPC services, on the GPU when one is present (the
# log says which backend and why); ARGS="..." adds flags, e.g. make run ARGS="--http-port 8000".
run: install $(DEFAULT_MODEL)/colibri.json
	$(BIN)/colibri serve --model $(or $(MODEL),$(DEFAULT_MODEL)) $(ARGS)

# Everything CI runs: unit, parity, kernel (simulator + sm_90 compile) and loopback end-to-end tests, and the
# protos' buf checks (tests/protos, hence buf); over TEST_WORKERS pytest-xdist processes: two per core on CI's two,
# since many tests wait on subprocess servers and sockets (the suite on a 2-core machine: 7.1 min with 4, 9.0 with 2).
TEST_WORKERS ?= 4
test: install $(BIN)/.installed-test $(CHECKOV_VENV)/bin/checkov $(BUF_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# GPU-only tests (run on a machine with an NVIDIA GPU), in two passes: GPU_WORKERS pytest-xdist processes share
# the GPU (`make test-gpu GPU_WORKERS=4`), then the `serial` tests run alone: they read the device's free memory,
# which the other processes' allocations would move. Both passes run; the target fails if either did. Every test
# process (the xdist workers, both passes, the services the tests start) shares one kernel cache, a fresh folder
# unless COLIBRI_KERNEL_CACHE names one: a kernel variant compiles once in the run, not once per process, and most
# of a GPU test's time is compiling (a tiny worker starts in 2.9 s with the cache filled, 14.8 s without).
GPU_WORKERS ?= 8
test-gpu: install $(BIN)/.installed-test
	status=0; cache=$${COLIBRI_KERNEL_CACHE:-$$(mktemp -d)}; \
	COLIBRI_KERNEL_CACHE=$$cache COLIBRI_TEST_GPU=1 $(BIN)/python -m pytest -q -n $(GPU_WORKERS) -m 'gpu and not serial' || status=1; \
	COLIBRI_KERNEL_CACHE=$$cache COLIBRI_TEST_GPU=1 $(BIN)/python -m pytest -q -m 'gpu and serial' || status=1; \
	exit $$status

# Lint, format check and type check ([tool.ruff], [tool.mypy] in pyproject.toml; CI runs this before `make test`).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# No Python file past 600 lines: split it by responsibility instead (CI runs this before `make test`).
lint-size:
	@! git ls-files '*.py' | xargs wc -l | awk '$$2 != "total" && $$1 > 600 {print; found=1} END {exit !found}'

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(BUF_DIR) .colibri
	find common/pb \( -name '*_pb2*.py' -o -name '*_pb2*.pyi' \) -delete
