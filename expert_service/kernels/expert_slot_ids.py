"""The slots a cached one-token step reads its experts from: slot_ids[k] = wave_map[ids[k]], wave_map being wave 0
of the layer's plan (expert_slot_map.py: the slot expert e reads in wave 0, -1: not in it). Reference: numpy
``np.where((ids >= 0) & (ids < E), wave_map[clip(ids)], -1)`` (tests/expert_service/kernels/test_expert_slot_ids.py).

The GEMV expert kernels (gemv.py launch_expert_gate_up / launch_expert_down) read each id on the device as a row
of their `experts` array; given these slot ids and the layer's slot buffer [S, stride] they run the step's experts
where the plan put them, with no host read (graph-capturable). The caller takes this path only when the union of
the step's ids fits one wave (T*K <= S), so every id has a slot in wave 0; an id outside [0, E) or not in wave 0
gets -1, which the caller must never hand to a kernel (the strategy choice guarantees it cannot happen).

  ids [n] int32        the step's routed experts (the token's top-k, flattened)
  wave_map [E] int32   the layer's wave-0 slot map after the plan
  slot_ids [n] int32   out: the slot of each id
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR

THREADS = 32 if SIMULATOR else 128


@cached_jit
def _slot_ids_kernel(ids, wave_map, slot_ids):
    """Module docstring: one thread per id."""
    k = cuda.grid(1)
    if k < ids.shape[0]:
        e = ids[k]
        s = -1
        if e >= 0 and e < wave_map.shape[0]:
            s = wave_map[e]
        slot_ids[k] = s


def _check(name, a, n=None):
    if a.dtype != np.int32 or a.ndim != 1 or not a.flags["C_CONTIGUOUS"] or (n is not None and a.shape[0] != n):
        size = "" if n is None else f"[{n}] "
        raise ValueError(f"{name} must be C-contiguous 1-d int32 {size}got {a.dtype} {list(a.shape)}")


def launch_expert_slot_ids(ids, wave_map, slot_ids, stream=0) -> None:
    """ids [n], wave_map [E], slot_ids [n] int32 (module docstring); n == 0 launches nothing."""
    _check("ids", ids)
    _check("wave_map", wave_map)
    n = ids.shape[0]
    _check("slot_ids", slot_ids, n)
    if n == 0:
        return
    _slot_ids_kernel[-(-n // THREADS), THREADS, stream](ids, wave_map, slot_ids)


def sm90_signatures():
    """(python function, numba signature) of the kernel, for the sm_90 compile check."""
    i1 = types.int32[::1]
    return [(_slot_ids_kernel.py_func, (i1, i1, i1))]
