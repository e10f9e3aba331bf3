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
PROTOS := protos/colibri/router/v1/router.proto protos/colibri/worker/v1/worker.proto
PB := common/pb/colibri/router/v1/router_pb2.py common/pb/colibri/worker/v1/worker_pb2.py
CHECKOV_VENV ?= .venv-checkov

.PHONY: run tiny test test-gpu proto install install-test lint-size clean

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
# common/pb/__init__.py (`from common.pb import router_pb2`). Stubs of the old flat layout are removed: loaded
# next to the new ones they would define the same messages twice.
$(PB): $(PROTOS) $(BIN)/.installed
	rm -f common/pb/*_pb2*.py common/pb/*_pb2*.pyi
	$(BIN)/python -m grpc_tools.protoc -Icommon/pb=protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
proto: $(PB)

install: $(BIN)/.installed $(PB)

# The default model: a small Mixtral trained on the World English Bible (docs/default-model.md), converted.
$(DEFAULT_MODEL)/colibri.json: $(DEFAULT_MODEL_HF)/model.safetensors $(DEFAULT_MODEL_HF)/config.json $(DEFAULT_MODEL_HF)/tokenizer.json | install
	$(BIN)/colibri convert $(DEFAULT_MODEL_HF) $(DEFAULT_MODEL) --dtype bfloat16

# A deterministic random-weight test model with a byte-level tokenizer (`make tiny`).
$(TINY_MODEL)/colibri.json: | install
	$(BIN)/colibri make-tiny $(TINY_MODEL)
tiny: $(TINY_MODEL)/colibri.json

# Serve the default model (or MODEL=DIR) through both gRPC services, on the GPU when one is present (the
# log says which backend and why); ARGS="..." adds flags, e.g. make run ARGS="--http-port 8000".
run: install $(DEFAULT_MODEL)/colibri.json
	$(BIN)/colibri serve --model $(or $(MODEL),$(DEFAULT_MODEL)) $(ARGS)

# Everything CI runs: unit, parity, kernel (simulator + sm_90 compile) and loopback end-to-end tests.
test: install $(BIN)/.installed-test $(CHECKOV_VENV)/bin/checkov
	$(BIN)/python -m pytest -q

# GPU-only tests (run on a machine with an NVIDIA GPU).
test-gpu: install $(BIN)/.installed-test
	COLIBRI_TEST_GPU=1 $(BIN)/python -m pytest -q -m gpu

# No Python file past 600 lines: split it by responsibility instead (CI runs this before `make test`).
lint-size:
	@! git ls-files '*.py' | xargs wc -l | awk '$$2 != "total" && $$1 > 600 {print; found=1} END {exit !found}'

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .colibri
	find common/pb \( -name '*_pb2*.py' -o -name '*_pb2*.pyi' \) -delete
