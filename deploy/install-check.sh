#!/usr/bin/env bash
# Runs the image's install steps outside Docker, in a fresh venv in a temporary directory:
#
#   1. copies the build context the Dockerfile sees (the `!` allow-list of .dockerignore, minus its excludes),
#   2. runs deploy/docker/install.sh on it, the script the Dockerfile's builder stage runs,
#   3. builds the tiny model and completes a prompt on the CPU with the installed `colibri`.
#
#   usage: deploy/install-check.sh [cpu|gpu]     (default cpu; gpu installs the cuda extra, no GPU needed)
#   PYTHON=python3.12 deploy/install-check.sh    (the interpreter for the venv; the images use Python 3.12)
#   KEEP=1 deploy/install-check.sh               (keep the temporary directory and print its path)
#
# It needs the package index the image build uses (pip's own configuration applies). Slow (a full install);
# tests/deploy/test_install_check.py runs it when COLIBRI_TEST_INSTALL=1.
set -euo pipefail

variant=${1:-cpu}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/colibri-install-check.XXXXXX")
if [[ "${KEEP:-0}" == 1 ]]; then
    echo "install-check: keeping $work"
else
    trap 'rm -rf "$work"' EXIT
fi
start=$SECONDS

# 1. The build context: every `!path` of .dockerignore, without caches and generated stubs.
mkdir -p "$work/src"
mapfile -t allowed < <(sed -n 's|^!\(.*[^/]\)/*$|\1|p' "$repo/.dockerignore")
(cd "$repo" && tar --exclude='__pycache__' --exclude='*.pyc' --exclude='*_pb2*.py' --exclude='*_pb2*.pyi' \
    -cf - "${allowed[@]}") | tar -xf - -C "$work/src"

# 2. The Dockerfile's install step, verbatim: `sh deploy/docker/install.sh VARIANT VENV SRC`.
(cd "$work/src" && sh deploy/docker/install.sh "$variant" "$work/venv" "$work/src")

# 3. The installed command works from outside the source tree.
cd "$work"
"$work/venv/bin/colibri" make-tiny "$work/tiny" --no-progress
"$work/venv/bin/colibri" complete --model "$work/tiny" --tokens 1,3,4 --max-new-tokens 4 --backend cpu

echo "install-check: $variant install ok in $((SECONDS - start)) s"
