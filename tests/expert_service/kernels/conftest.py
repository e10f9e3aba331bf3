"""Kernel tests run in Numba's CUDA simulator (unless COLIBRI_TEST_GPU=1): pace it, and close a race in it."""

from __future__ import annotations

import sys
import threading
import traceback

import numpy as np
import pytest


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
