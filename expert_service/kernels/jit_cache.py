"""Kernels compiled once per machine instead of once per process.

With COLIBRI_KERNEL_CACHE=DIR in the environment, every kernel is compiled with Numba's on-disk cache
(``cuda.jit(cache=True)``) under DIR/<digest>, so a restarted worker — a new pod on a node that keeps the cache
volume — loads its compiled kernels instead of compiling them again (docs/deploy.md has the start-up figures).
The digest covers the sources of every kernel module and the numba-cuda version: Numba keys a cached kernel by
its own file only, not by the device functions it inlines from other files, so without it an edited helper
could be served from a stale cache. Unset (the default for a checkout), kernels compile in memory as usual.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numba_cuda
from numba import cuda
from numba.cuda.core import config as cuda_config

from expert_service.kernels.numeric import SIMULATOR

CACHE_ENV = "COLIBRI_KERNEL_CACHE"
log = logging.getLogger("colibri.worker.kernels")


def source_digest(folder: Path = Path(__file__).parent) -> str:
    """A digest of the kernel modules' sources in `folder` and the compiler version (the cache folder's name)."""
    digest = hashlib.sha256(numba_cuda.__version__.encode())
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _cache_dir() -> Path | None:
    root = os.environ.get(CACHE_ENV, "").strip()
    if not root or SIMULATOR:
        return None
    folder = Path(root) / source_digest()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        # A cache that cannot be written must not stop the worker: it only costs the compile time.
        log.warning("%s=%s is not writable (%s); kernels compile without a cache", CACHE_ENV, root,
                    exc.strerror or exc)
        return None
    return folder


CACHE_DIR = _cache_dir()
if CACHE_DIR is not None:
    cuda_config.CACHE_DIR = str(CACHE_DIR)
    os.environ["NUMBA_CACHE_DIR"] = str(CACHE_DIR)     # the same if Numba re-reads its configuration


def cached_jit(kernel):
    """``cuda.jit`` for a kernel (not a device function), cached on disk when COLIBRI_KERNEL_CACHE is set."""
    return cuda.jit(kernel, cache=True) if CACHE_DIR is not None else cuda.jit(kernel)
