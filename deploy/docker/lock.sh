#!/bin/sh
# Writes the image's lock files: every runtime dependency of the image, pinned to one version with the
# sha256 of each of its files, resolved by uv from pyproject.toml (plus the cuda extra for gpu) and
# deploy/docker/image-requirements.in. deploy/docker/install.sh installs from them with --require-hashes.
#
#   usage: deploy/docker/lock.sh          (from any directory; needs uv, see UV_VERSION, and the package index)
#
# Reproducible: the resolution is universal (every platform and Python >= 3.12, so the same files serve
# x86_64 and arm64 images) and sees only releases published before EXCLUDE_NEWER, so running it again gives
# the same files. To refresh the pins: move EXCLUDE_NEWER to today, run it, read the diff, build and test
# the image (deploy/install-check.sh), commit. docs/deploy.md, "Dependencies", says more.
set -eu

EXCLUDE_NEWER=2026-12-01T00:00:00Z
UV_VERSION=0.13.8

if ! command -v uv >/dev/null 2>&1; then
    echo "lock.sh: uv is not on PATH (python -m pip install uv==$UV_VERSION)" >&2
    exit 2
fi
found=$(uv --version | cut -d' ' -f2)
if [ "$found" != "$UV_VERSION" ]; then
    echo "lock.sh: uv $UV_VERSION writes these files, found uv $found (python -m pip install uv==$UV_VERSION)" >&2
    exit 2
fi

cd "$(dirname "$0")/../.."
for variant in cpu gpu; do
    extra=""
    if [ "$variant" = gpu ]; then extra="--extra cuda"; fi
    # shellcheck disable=SC2086  # $extra is empty or two words
    uv --quiet pip compile pyproject.toml deploy/docker/image-requirements.in $extra \
        --universal --python-version 3.12 --exclude-newer "$EXCLUDE_NEWER" --generate-hashes \
        --custom-compile-command "deploy/docker/lock.sh" \
        --output-file "deploy/docker/requirements-$variant.lock"
    echo "lock.sh: wrote deploy/docker/requirements-$variant.lock"
done
