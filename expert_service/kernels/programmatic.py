"""Programmatic dependent launch (sm_90): kernel variants a captured graph may start before their predecessor ends.

A one-token decode step is ~90 short kernels in a row; each boundary costs the next kernel's launch and ramp-up
while the device drains the previous one. A graph edge of type PROGRAMMATIC lets the dependent's blocks become
resident once every block of its predecessor has executed `griddepcontrol.launch_dependents`; they then wait in
`griddepcontrol.wait`, which returns when the predecessor has completed and its writes are visible.

A *waiting* variant of a kernel executes both at its very top, before it touches memory, so it computes exactly
what the plain kernel computes whatever edge reaches it: the same arithmetic in the same order, only its start
moves. Two things make that hold:
- every block executes the wait (it is the kernel's first statement), so a waiting kernel never completes before
  its predecessor, and a kernel after it, on any edge, finds everything before it done;
- loads of data an earlier kernel writes must not go through the non-coherent path: ptxas may hoist an `.nc` load
  above the wait (the memory model does not cover them), so the variants load activations with
  `ptx.ld_*_coherent`. Weight streams keep `.nc`: they read what no kernel writes while the engine runs, so such a
  load hoisted above the wait reads the same bytes early (an expert cache's slots are written during the step,
  which is why only engines without one use the variants). `tests/expert_service/kernels/test_programmatic.py`
  reads each variant's sm_90 SASS: no load but a weight stream before the wait.

How the variants are used: the decoder issues a step inside `launches(True)`; launchers that have a variant ask
`active()` and build the waiting one (a compile-time flag of their kernel factory, `prologue(True)` at its top),
and register it (`compiled(kernel, wait)`). When a capture ends, `cuda.driver.Graph` turns every kernel -> kernel
edge into a registered kernel into a programmatic one. Outside a capture, or on a plain edge, both instructions
return at once.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from numba import cuda

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.ptx import griddep_launch_dependents, griddep_wait, ld_v4, ld_v4_coherent

_state = threading.local()
_WAITING: list = []  # dispatchers of waiting variants (kernel factories cache them: each is built once)
_WAITING_FUNCTIONS: set = set()


@contextlib.contextmanager
def launches(enabled: bool):
    """Launchers called on this thread inside the block build their waiting variants when `enabled`."""
    previous = active()
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


@functools.cache
def supported() -> bool:
    """Whether the device runs the waiting variants' instructions (sm_90 and later); the simulator runs them as
    plain kernels."""
    return SIMULATOR or cuda.get_current_device().compute_capability >= (9, 0)


def active() -> bool:
    """Whether launchers on this thread are to build waiting variants now."""
    return getattr(_state, "enabled", False)


def compiled(kernel, wait: bool, launch_bounds=None):
    """`jit_cache.cached_jit(kernel)`, registered as a waiting variant when `wait` (its python function is one
    of `waiting_functions()`, its overloads' handles among `handles()`)."""
    dispatcher = cached_jit(kernel) if launch_bounds is None else cached_jit(kernel, launch_bounds=launch_bounds)
    if wait:
        _WAITING.append(dispatcher)
        _WAITING_FUNCTIONS.add(kernel)
    return dispatcher


def waiting_functions() -> frozenset:
    """The python functions of the waiting variants built so far (the sm_90 order check reads their SASS)."""
    return frozenset(_WAITING_FUNCTIONS)


def handles() -> set[int]:
    """The CUfunction handles of every compiled overload of every registered waiting variant: the graph nodes
    whose incoming kernel edges may be programmatic."""
    return set().union(*(dispatcher_handles(dispatcher) for dispatcher in _WAITING))


def dispatcher_handles(dispatcher) -> set[int]:
    """The kernel handles of a jitted kernel's compiled overloads (what its graph nodes run)."""
    return {int(kernel._codelibrary.get_cufunc().handle) for kernel in getattr(dispatcher, "overloads", {}).values()}


@functools.cache
def prologue(wait: bool):
    """The device function a kernel calls first: for a waiting variant, let the dependents' blocks start and wait
    for the predecessor (module docstring); otherwise nothing."""
    if wait:

        @cuda.jit(device=True, inline=True)
        def wait_first():
            griddep_launch_dependents()
            griddep_wait()

        return wait_first

    @cuda.jit(device=True, inline=True)
    def nothing():
        pass

    return nothing


def activation_load(wait: bool):
    """The 16-byte load of data an earlier kernel wrote: `ld_v4` (L1-cached `.nc`), or its coherent twin in a
    waiting variant."""
    return ld_v4_coherent if wait else ld_v4
