# Colibri: `make run` serves the embedded tiny model, `make test` runs the test suite; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TINY_MODEL ?= .colibri/tiny-mixtral
PROTOS := protos/router.proto protos/worker.proto
PB := common/pb/router_pb2.py common/pb/worker_pb2.py
CHECKOV_VENV ?= .venv-checkov

.PHONY: run test test-gpu proto install install-test lint-size clean

# Runtime dependencies + the package (editable) in .venv.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
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

# gRPC stubs (and .pyi type stubs) from protos/, importable as common.pb.*
$(PB): $(PROTOS) $(BIN)/.installed
	$(BIN)/python -m grpc_tools.protoc -Icommon/pb=protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
proto: $(PB)

install: $(BIN)/.installed $(PB)

# The embedded default model: a deterministic random-weight Mixtral with a byte-level tokenizer.
$(TINY_MODEL)/colibri.json: | install
	$(BIN)/colibri make-tiny $(TINY_MODEL)

# Serve the tiny model (or MODEL=DIR) through both gRPC services; CPU when no GPU is present.
run: install $(TINY_MODEL)/colibri.json
	$(BIN)/colibri serve --model $(or $(MODEL),$(TINY_MODEL))

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
	rm -rf $(VENV) $(CHECKOV_VENV) common/pb/*_pb2*.py common/pb/*_pb2*.pyi .colibri
