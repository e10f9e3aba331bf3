"""Kernels compiled once per machine instead of once per process.

With COLIBRI_KERNEL_CACHE=DIR in the environment, every kernel is compiled with Numba's on-disk cache
(``cuda.jit(cache=True)``) under DIR/<digest>, so a restarted worker — a new pod on a node that keeps the cache
volume — loads its compiled kernels instead of compiling them again (docs/deploy.md has the start-up figures).
The digest covers the sources of every kernel module and the numba-cuda version: Numba keys a cached kernel by
its own file only, not by the device functions it inlines from other files, so without it an edited helper
could be served from a stale cache. Unset (the default for a checkout), kernels compile in memory as usual.

Kernels built by factories close over device functions made in the factory. Numba keys such a kernel by the
pickled closure, and a pickled device function carries a random per-process id, so the key would differ in
every process and the kernel would never be found: `pin_closure_ids` gives those device functions, and the
intrinsics they use, ids derived from their code and what they reach instead.
"""
from __future__ import annotations

import hashlib
import logging
import os
import types
import uuid
from pathlib import Path

import numba_cuda
from numba import cuda
from numba.cuda.core import config as cuda_config
from numba.cuda.dispatcher import CUDADispatcher
from numba.cuda.extending import _Intrinsic  # type: ignore[attr-defined]  # numba's own numba/cuda lacks it; numba-cuda has it
from numba.cuda.serialize import dumps

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


def _fingerprint(value, memo: dict) -> bytes:
    """Bytes that are the same in every process for the same closure value (pins the ids it reaches)."""
    if isinstance(value, (CUDADispatcher, _Intrinsic)):
        return _pin(value, memo).encode()
    if isinstance(value, types.FunctionType):
        return _function_digest(value, memo).encode()
    return dumps(value)


def _global_names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _function_digest(fn, memo: dict) -> str:
    """A digest of fn's code, closure and the device functions and intrinsics it reaches through globals."""
    if id(fn) in memo:
        return memo[id(fn)]
    memo[id(fn)] = f"{fn.__module__}.{fn.__qualname__}"        # a recursive reference stops here
    digest = hashlib.sha256(memo[id(fn)].encode() + fn.__code__.co_code)
    for cell in fn.__closure__ or ():
        digest.update(_fingerprint(cell.cell_contents, memo))
    for name in sorted(set(_global_names(fn.__code__))):
        value = fn.__globals__.get(name)
        if isinstance(value, (CUDADispatcher, _Intrinsic, types.FunctionType)):
            digest.update(name.encode() + _fingerprint(value, memo))
    memo[id(fn)] = digest.hexdigest()
    return memo[id(fn)]


def _pin(obj, memo: dict) -> str:
    """A device function's or intrinsic's id, set from its code and what it reaches unless it has one."""
    dispatcher = isinstance(obj, CUDADispatcher)
    if (obj._MemoMixin__uuid if dispatcher else obj._Intrinsic__uuid) is None:
        fn = obj.py_func if dispatcher else obj._defn
        obj._set_uuid(str(uuid.UUID(_function_digest(fn, memo)[:32])))
    return obj._uuid


def pin_closure_ids(kernel) -> None:
    """Stable ids for the device functions and intrinsics `kernel` reaches (module docstring)."""
    _function_digest(kernel, {})


def cached_jit(kernel, launch_bounds=None):
    """``cuda.jit`` for a kernel (not a device function), cached on disk when COLIBRI_KERNEL_CACHE is set.
    launch_bounds: (threads per block, blocks per SM) the kernel is compiled for (ptxas caps its registers to fit);
    the simulator has no registers and ignores it."""
    options = {"launch_bounds": launch_bounds} if launch_bounds is not None and not SIMULATOR else {}
    if CACHE_DIR is None:
        return cuda.jit(kernel, **options)
    pin_closure_ids(kernel)
    dispatcher = cuda.jit(kernel, cache=True, **options)
    name_data_by_key(dispatcher._cache._cache_file)
    if "launch_bounds" in options:
        key_launch_bounds(dispatcher, tuple(launch_bounds))
    return dispatcher


def name_data_by_key(cache_file) -> None:
    """Numba names a kernel's cached variants 1, 2, ... in the order its index learned of them: two processes
    compiling two variants at once (a worker's xdist test processes, two worker pods of one node sharing the cache
    volume) both read an index without the other's and both take number 1, and the index one wrote can end up
    naming the data the other wrote -- a later process then loads one variant's code for the other, with wrong
    results and no error. Each variant's data is named by a digest of its key instead, so an index entry can
    only ever name that key's own code, and is stored with its key, which a load checks; the data is written
    before the entry, and the index is read again just before it is rewritten. An entry lost to a concurrent
    rewrite only costs a compile."""
    numbered = cache_file._data_name_pattern
    if "{number:d}" not in numbered:
        raise RuntimeError(f"numba-cuda's cache names data files {numbered!r}; jit_cache expects a {{number:d}} field")
    pattern = numbered.replace("{number:d}", "{digest}")

    def save(key, data) -> None:
        name = pattern.format(digest=hashlib.sha256(repr(key).encode()).hexdigest()[:32])
        cache_file._save_data(name, (key, data))   # the key beside the code: load checks it (equal reprs of
        overloads = cache_file._load_index()       # unequal keys would otherwise share a file)
        overloads[key] = name
        cache_file._save_index(overloads)

    def load(key):
        name = cache_file._load_index().get(key)
        if name is None:
            return None
        try:
            stored = cache_file._load_data(name)
        except OSError:   # removed while the index still named it
            return None
        return stored[1] if isinstance(stored, tuple) and len(stored) == 2 and stored[0] == key else None

    cache_file.save, cache_file.load = save, load


def key_launch_bounds(dispatcher, launch_bounds: tuple) -> None:
    """Numba keys a cached kernel by its signature, bytecode and closure, not by the launch bounds it was compiled
    for: the same kernel built for two bounds (bench/q8_kernels.py's launch shapes, say) would load whichever was
    cached first. The bounds join this dispatcher's keys."""
    cache = dispatcher._cache
    index_key = cache._index_key
    cache._index_key = lambda sig, codegen: (*index_key(sig, codegen), ("launch_bounds", launch_bounds))
