"""Shared pieces of the MoE kernel tests: expert weight buffers in the model-file layout and simulator pacing."""
from __future__ import annotations

import sys
import threading
import traceback

import numpy as np
import pytest

from common.dtypes import bf16_to_float32, float32_to_bf16

GPU_ONLY = pytest.mark.gpu
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")


def _locked_shared_array(lock):
    """numba-cuda 0.30 simulator FakeCUDAShared.array creates a block's shared array lazily on first use
    without a lock: two threads can both miss and one writes into an orphaned copy (seen as a wrong top-k).
    Same lookup (keyed by the caller's file and line), under a lock."""
    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)
        from numba.core import types
        from numba.np import numpy_support
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    original = FakeCUDAShared.array
    return FakeCUDAShared, original, array


@pytest.fixture(autouse=True, scope="module")
def fast_simulator_threads():
    """The simulator runs a Python thread per CUDA thread and busy-polls them at every barrier; a short GIL
    switch interval lets blocked threads resume quickly (5x faster here). Also closes the simulator's
    shared-array creation race, which the faster switching makes likely."""
    from numba.cuda import config
    if not config.ENABLE_CUDASIM:
        yield
        return
    cls, original, patched = _locked_shared_array(threading.Lock())
    old = sys.getswitchinterval()
    cls.array = patched
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)
    cls.array = original


def expert_buffer(rng, n_exp: int, F: int, D: int, dtype: str, scale: float = 0.3):
    """W [E, stride] in the storage dtype (stride = 4096-byte multiple, padding filled with NaN bits so a stray
    read shows) and the exact float32 values of each expert's (gate [F, D], up [F, D], down [D, F])."""
    store = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}[dtype]
    item = np.dtype(store).itemsize
    stride = -(-3 * F * D * item // 4096) * 4096 // item
    vals = (rng.standard_normal((n_exp, 3 * F * D)) * scale).astype(np.float32)
    if dtype == "bfloat16":
        words = float32_to_bf16(vals)
        exact = bf16_to_float32(words)
        W = np.full((n_exp, stride), 0x7FC1, np.uint16)
    else:
        words = vals.astype(store)
        exact = words.astype(np.float32)
        W = np.full((n_exp, stride), np.nan, store)
    W[:, :3 * F * D] = words
    mats = [(e[:F * D].reshape(F, D), e[F * D:2 * F * D].reshape(F, D), e[2 * F * D:].reshape(D, F)) for e in exact]
    return W, mats


def random_ids(rng, n_tok: int, top_k: int, n_exp: int) -> np.ndarray:
    return np.stack([rng.choice(n_exp, size=top_k, replace=False) for _ in range(n_tok)]).astype(np.int32)


def has_gpu() -> bool:
    from numba import cuda
    from numba.cuda import config
    if config.ENABLE_CUDASIM:
        return False
    try:
        return cuda.is_available()
    except Exception:
        return False
