"""The simulator pacing (tests/simulator.py) keeps the simulator's semantics: a barrier waits for every live thread
of the block (threads that returned early no longer count), shared memory written before it is seen after it,
blocks run one after another, a failing thread's own error reaches the caller, not the abort of the others, and
device functions see the launch's thread indices while the module's `cuda` is the real one again after it."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.numeric import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the pacing is the simulator's")
THREADS = 48


@cuda.jit
def _reverse_sums(x, out, early):
    """out[b, t] = x[b, THREADS-1-t] + the sum of x[b] over the threads that stayed (two barriers each round);
    threads t >= early return before the first barrier."""
    shared = cuda.shared.array(THREADS, np.float32)
    total = cuda.shared.array(1, np.float32)
    t, b = cuda.threadIdx.x, cuda.blockIdx.x
    if t >= early:
        return
    shared[t] = x[b, t]
    if t == 0:
        total[0] = 0.0
    cuda.syncthreads()
    if t == 0:
        for i in range(early):
            total[0] += shared[i]
    cuda.syncthreads()
    out[b, t] = shared[early - 1 - t] + total[0]


@cuda.jit(device=True)
def _thread_index():
    return cuda.threadIdx.x


@cuda.jit
def _fails_in_one_thread(out):
    t = _thread_index()
    cuda.syncthreads()
    if t == 5:
        raise ValueError("thread five")
    cuda.syncthreads()
    out[t] = t


@pytest.mark.parametrize("early", [THREADS, 17])
def test_barriers_wait_for_every_live_thread(early):
    rng = np.random.default_rng(early)
    x = rng.standard_normal((3, THREADS)).astype(np.float32)
    out = np.full((3, THREADS), np.nan, np.float32)
    _reverse_sums[3, THREADS](x, out, early)
    want = x[:, :early][:, ::-1] + np.cumsum(x[:, :early], axis=1, dtype=np.float32)[:, -1:]  # thread 0's order
    np.testing.assert_array_equal(out[:, :early], want)
    assert np.isnan(out[:, early:]).all()


def test_a_failing_thread_raises_its_own_error():
    with pytest.raises(ValueError, match="thread five"):
        _fails_in_one_thread[1, 32](np.zeros(32, np.int32))
    assert globals()["cuda"] is sys.modules["numba.cuda"]
    out = np.full(5, -1, np.int32)  # the next launch runs normally
    _fails_in_one_thread[1, 5](out)
    assert (out == np.arange(5)).all() and globals()["cuda"] is sys.modules["numba.cuda"]
