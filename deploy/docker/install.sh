#!/bin/sh
# Installs Colibri from a source tree into a fresh virtual environment: first every runtime dependency from
# the variant's lock file (exact versions, sha256 checked), then colibri itself on top without resolving
# again, then `pip check`, which fails when the lock misses something pyproject.toml asks for.
#
# The image's build stage runs this script (deploy/Dockerfile), and so does deploy/install-check.sh in CI,
# so the commands that build the image are the commands that are tested.
#
#   usage: install.sh VARIANT VENV_DIR SOURCE_DIR
#     VARIANT     gpu: deploy/docker/requirements-gpu.lock, then SOURCE_DIR[cuda] (numba-cuda, CUDA 13 wheels)
#                 cpu: deploy/docker/requirements-cpu.lock, then SOURCE_DIR (numpy backend only)
#     VENV_DIR    the virtual environment to create (must not exist yet)
#     SOURCE_DIR  a checkout: pyproject.toml, setup.py, protos/, the packages, deploy/docker/*.lock
#
# PYTHON selects the interpreter that creates the venv (default: python3). setup.py generates the gRPC stubs
# during the build (grpcio-tools is a build requirement in pyproject.toml), so the source tree needs no
# `make proto` first.
set -eu

if [ "$#" -ne 3 ]; then
    echo "usage: $0 gpu|cpu VENV_DIR SOURCE_DIR" >&2
    exit 2
fi
variant=$1
venv=$2
src=$3

case "$variant" in
    gpu) target="$src[cuda]" ;;
    cpu) target="$src" ;;
    *) echo "install.sh: VARIANT must be gpu or cpu, got '$variant'" >&2; exit 2 ;;
esac
lock="$src/deploy/docker/requirements-$variant.lock"
if [ ! -f "$lock" ]; then
    echo "install.sh: $lock is missing (deploy/docker/lock.sh writes it)" >&2
    exit 2
fi
if [ -e "$venv" ]; then
    echo "install.sh: $venv already exists; the install is meant for a fresh venv" >&2
    exit 2
fi

PIP_VERSION=26.3

"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check "pip==$PIP_VERSION"
# Hash-checking mode: every package pip would install, dependencies included, must be in the lock with
# its hashes, so nothing unpinned or altered gets in.
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --require-hashes -r "$lock"
# Colibri itself: its dependencies are the ones just installed (setup.py's build requirements come from the
# index into pip's isolated build environment, not into the venv).
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --no-deps "$target"
"$venv/bin/python" -m pip check

# Smoke test: the entry point starts, and the gRPC stubs generated at build time were installed and import.
"$venv/bin/colibri" --help >/dev/null
"$venv/bin/python" -I - <<'PY'   # -I: import the installed package, not the source tree in the cwd
import importlib
from importlib.metadata import files

stubs = sorted(str(f) for f in files("colibri") or () if f.name.endswith(("_pb2.py", "_pb2_grpc.py")))
if not stubs:
    raise SystemExit("install.sh: the colibri distribution holds no generated gRPC stubs (*_pb2.py)")
for stub in stubs:
    importlib.import_module(stub[:-3].replace("/", "."))
print(f"install.sh: colibri installed, {len(stubs)} gRPC stub modules import")
PY
