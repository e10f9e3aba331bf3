"""Programmatic dependent launch (sm_90): kernel variants a captured graph may start before their predecessor ends.

A one-token decode step is ~90 short kernels in a row; each boundary costs the next kernel's launch and ramp-up
while the device drains the previous one. A graph edge of type PROGRAMMATIC lets the dependent's blocks become
resident once every block of its predecessor has executed `griddepcontrol.launch_dependents`; they then wait in
`griddepcontrol.wait`, which returns when the predecessor has completed and its writes are visible.

A kernel factory of the chain takes a compile-time `mode`: PLAIN; WAIT, which executes both instructions as its
first statements; TRIGGER, only `launch_dependents` (it never waits, so no programmatic edge may reach it);
PREFETCH (the dense GEMV), which triggers, issues its first weight loads, then waits. The arithmetic and its order
never change, so every variant computes the plain kernel's bits, whatever edge reaches it. What makes the order hold:
- every block of a waiting variant (WAIT, PREFETCH) waits before it reads anything an earlier kernel wrote, so it
  never completes before its predecessor, and a kernel after it, on any edge, finds everything before it done;
  letting dependents start early is safe in any kernel, since only a waiting kernel can start early;
- loads of data an earlier kernel writes must not go through the non-coherent path: ptxas may hoist an `.nc` load
  above the wait (the memory model does not cover them), so waiting variants load activations with
  `ptx.ld_*_coherent`. Weight streams keep `.nc`: they read what no kernel writes while the engine runs, so one
  ahead of the wait reads the same bytes early (an expert cache's slots are written during the step, which is why
  only engines without one use the variants). The sm_90 compile check (`tests/expert_service/kernels/
  test_compile_sm90.py`) reads the SASS of the waiting variants the kernel modules list: no global access but a
  weight stream before the wait, and no `.nc` load but weight streams anywhere.

How the variants are used: the decoder issues a decode step inside `launches(level)` (CudaOptions.
programmatic_launch: EVERY_KERNEL, every kernel WAIT; WEIGHTS_FIRST, the dense GEMVs PREFETCH and the rest
TRIGGER); each launcher asks `mode()` for its variant and its factory registers the waiting ones (`compiled`).
When a capture ends, `cuda.driver.Graph` turns every kernel -> kernel edge into a registered kernel into a
programmatic one. Outside a capture, or on a plain edge, both instructions return at once.
"""

from __future__ import annotations

import contextlib
import threading

from numba import cuda

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.ptx import griddep_launch_dependents, griddep_wait, ld_v4, ld_v4_coherent

_state = threading.local()
_WAITING: list = []  # dispatchers of waiting variants (kernel factories cache them: each is built once)
_WAITING_FUNCTIONS: set = set()

# The variant a kernel factory builds (its `mode`): PLAIN; WAIT: trigger, then wait, as its first statements;
# TRIGGER: trigger only (it never waits, so no programmatic edge may reach it); PREFETCH: trigger, issue the
# first weight loads, then wait (a GEMV's weights are what no kernel writes).
PLAIN, WAIT, TRIGGER, PREFETCH = 0, 1, 2, 3
MODES = (PLAIN, WAIT, TRIGGER, PREFETCH)
# The levels a decode step is issued at (CudaOptions.programmatic_launch): OFF; EVERY_KERNEL: every kernel of the
# chain WAIT; WEIGHTS_FIRST: the GEMVs PREFETCH, every other kernel TRIGGER, so only edges into GEMVs are
# programmatic and those kernels' weights stream while their predecessor drains.
OFF, EVERY_KERNEL, WEIGHTS_FIRST = 0, 1, 2


@contextlib.contextmanager
def launches(level: int):
    """Launchers called on this thread inside the block build the variants of `level` (OFF, EVERY_KERNEL or
    WEIGHTS_FIRST)."""
    previous = active()
    _state.level = level
    try:
        yield
    finally:
        _state.level = previous


def supported() -> bool:
    """Whether the current device runs the variants' instructions (sm_90 and later); the simulator runs them as
    plain kernels."""
    return SIMULATOR or cuda.get_current_device().compute_capability >= (9, 0)


def refusal(cached: bool) -> str:
    """The one-line warning of an engine given programmatic_launch that runs the plain kernels instead."""
    why = "its expert cache writes weights mid-step" if cached else "its device is older than sm_90"
    return f"cuda_options.programmatic_launch: off on this engine, {why}"


def active() -> int:
    """The level launchers on this thread build variants for now (OFF outside `launches`)."""
    return getattr(_state, "level", OFF)


def mode(prefetches: bool = False) -> int:
    """The variant a launcher builds now: PLAIN outside the mode, WAIT at EVERY_KERNEL; at WEIGHTS_FIRST, PREFETCH
    for a kernel that can issue its first weight loads before waiting (`prefetches`), TRIGGER for the others."""
    level = active()
    if level == EVERY_KERNEL:
        return WAIT
    if level == WEIGHTS_FIRST:
        return PREFETCH if prefetches else TRIGGER
    return PLAIN


def waits(kind: int) -> bool:
    """Whether variants of this mode wait for a programmatic predecessor (so edges into them may be programmatic
    and their activation loads must be coherent)."""
    return kind in (WAIT, PREFETCH)


def compiled(kernel, kind: int, launch_bounds=None):
    """`jit_cache.cached_jit(kernel)`, registered as a waiting variant when its mode waits (its python function
    is one of `waiting_functions()`, its overloads' handles among `handles()`)."""
    dispatcher = cached_jit(kernel) if launch_bounds is None else cached_jit(kernel, launch_bounds=launch_bounds)
    if waits(kind):
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


@cuda.jit(device=True, inline=True)
def _nothing():
    pass


@cuda.jit(device=True, inline=True)
def _trigger_then_wait():
    griddep_launch_dependents()
    griddep_wait()


def prologue(kind: int):
    """The device function a kernel of this mode calls first: WAIT lets the dependents' blocks start and waits for
    the predecessor; TRIGGER and PREFETCH only let them start (PREFETCH waits later, `late_wait`); PLAIN nothing."""
    return {WAIT: _trigger_then_wait, TRIGGER: griddep_launch_dependents, PREFETCH: griddep_launch_dependents}.get(
        kind, _nothing
    )


def late_wait(kind: int):
    """The wait a PREFETCH kernel calls after its first weight loads, before it reads anything an earlier kernel
    wrote (every thread exactly once); nothing in the other modes."""
    return griddep_wait if kind == PREFETCH else _nothing


def activation_load(kind: int):
    """The 16-byte load of data an earlier kernel wrote: `ld_v4` (L1-cached `.nc`), or its coherent twin in a
    waiting variant."""
    return ld_v4_coherent if waits(kind) else ld_v4
