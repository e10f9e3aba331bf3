"""Pacing of Numba's CUDA simulator for the tests (numba-cuda 0.30): what a kernel computes is unchanged, only how
the simulator's Python threads wait for each other.

The simulator runs every CUDA thread of a block as a Python thread. Its BlockManager finds a `syncthreads` barrier
complete by busy-polling every thread's flag, so it holds the GIL against the very threads it waits for, and a
blocked thread sleeps on an Event until the poller notices. Here the barrier is a counter under a condition
variable: the last thread to arrive releases the others at once, a thread that ends counts as departed (as the
poller treated it), and an exception in one thread aborts the rest as before.

Also closes a race in FakeCUDAShared.array and makes its lookup cheap (below).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


class _Aborted(RuntimeError):
    """Raised in a thread waiting at a barrier when another thread of its block failed."""


class _Barrier:
    """`syncthreads` over a block's live threads: released when every thread still running has arrived."""

    def __init__(self, live: int):
        self.cond = threading.Condition()
        self.live = live
        self.arrived = 0
        self.generation = 0
        self.aborted = False

    def _release(self) -> None:
        self.arrived = 0
        self.generation += 1
        self.cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            if self.aborted:
                raise _Aborted("abort flag set on syncthreads call")
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.live:
                self._release()
            while generation == self.generation and not self.aborted:
                self.cond.wait()
            if self.aborted:
                raise _Aborted("abort flag set on syncthreads clear")

    def depart(self, failed: bool) -> None:
        with self.cond:
            self.live -= 1
            if failed:
                self.aborted = True
                self.cond.notify_all()
            elif self.live and self.arrived == self.live:
                self._release()
            if not self.live:
                self.cond.notify_all()


def _run_block(self, grid_point, *args) -> None:
    """BlockManager.run: start the block's threads, wait until all have ended (or one failed), re-raise the first
    failure with its traceback."""
    from numba.cuda.simulator.kernel import BlockThread

    barrier = _Barrier(int(np.prod(self._block_dim)))
    threads = []

    def target():
        self._f(*args)

    for block_point in np.ndindex(*self._block_dim):
        thread = BlockThread(target, self, grid_point, block_point, self._debug)
        thread._barrier = barrier
        threads.append(thread)
    for thread in threads:
        thread.start()
    with barrier.cond:
        while barrier.live and not barrier.aborted:
            barrier.cond.wait()
    failed = [t for t in threads if t.exception and not isinstance(t.exception[0], _Aborted)]
    failed = failed or [t for t in threads if t.exception]
    if failed:
        raise failed[0].exception[0].with_traceback(failed[0].exception[1])


def _thread_run(self) -> None:
    try:
        _original_thread_run(self)
    finally:
        self._barrier.depart(self.exception is not None)


def _syncthreads(self) -> None:
    self._barrier.wait()


_original_thread_run = None


# Module globals swapped to the launch's fake cuda module: id(globals) -> (globals, the names' real values).
_launch_swaps: dict[int, tuple[dict, dict]] = {}
_swap_lock = threading.Lock()


@contextmanager
def _swapped_for_the_launch(fn, fake_cuda_module) -> Iterator[None]:
    """swapped_cuda_module for calls inside a launch: a module's `cuda` names point at the launch's fake module
    from its first call until the launch ends (_launch), where the stock one scans the module's globals and
    swaps them back around every device-function call of every thread."""
    from numba.cuda.simulator import kernel

    if fake_cuda_module is not kernel._kernel_context:
        with _stock_swap(fn, fake_cuda_module):
            yield
        return
    globs = fn.__globals__
    if id(globs) not in _launch_swaps:
        from numba import cuda

        with _swap_lock:
            if id(globs) not in _launch_swaps:
                real = {k: v for k, v in globs.items() if v is cuda}
                globs.update(dict.fromkeys(real, fake_cuda_module))
                _launch_swaps[id(globs)] = (globs, real)
    yield


def _launch(self, *args):
    """FakeCUDAKernel.__call__ that puts back, once the launch is over, what its device calls swapped."""
    from numba.cuda.simulator import kernel

    if self._device or kernel._kernel_context:
        return _stock_call(self, *args)
    try:
        return _stock_call(self, *args)
    finally:
        with _swap_lock:
            for globs, real in _launch_swaps.values():
                globs.update(real)
            _launch_swaps.clear()


_stock_swap = _stock_call = None


def _locked_shared_array(lock: threading.Lock):
    """numba-cuda 0.30's FakeCUDAShared.array creates a block's shared array lazily on first use without a lock:
    two threads can both miss and one writes into an orphaned copy (seen as a wrong top-k). Same lookup (keyed by
    the caller's file and line), under a lock. The stock lookup extracts the whole stack (a stat of every frame's
    file through linecache) on every call: most of a simulated kernel's time where it calls warp_sum in a loop."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    original = FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)
        from numba.core import types
        from numba.np import numpy_support

        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)  # the caller: what the stock traceback.extract_stack found, without linecache
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    return FakeCUDAShared, original, array


@contextmanager
def paced_simulator() -> Iterator[None]:
    """The event-driven barrier and the locked shared arrays while the block runs; a no-op off the simulator."""
    global _original_thread_run, _stock_swap, _stock_call
    from numba.cuda import config

    if not config.ENABLE_CUDASIM:
        yield
        return
    from numba.cuda.simulator import kernel
    from numba.cuda.simulator.kernel import BlockManager, BlockThread, FakeCUDAKernel

    shared_cls, shared_original, shared_patched = _locked_shared_array(threading.Lock())
    saved = BlockManager.run, BlockThread.run, BlockThread.syncthreads, FakeCUDAKernel.__call__
    _original_thread_run, _stock_call, _stock_swap = (
        BlockThread.run,
        FakeCUDAKernel.__call__,
        kernel.swapped_cuda_module,
    )
    BlockManager.run, BlockThread.run, BlockThread.syncthreads = _run_block, _thread_run, _syncthreads
    FakeCUDAKernel.__call__, kernel.swapped_cuda_module = _launch, _swapped_for_the_launch
    shared_cls.array = shared_patched
    try:
        yield
    finally:
        BlockManager.run, BlockThread.run, BlockThread.syncthreads, FakeCUDAKernel.__call__ = saved
        kernel.swapped_cuda_module = _stock_swap
        shared_cls.array = shared_original
