"""The plan prefetch's predicted experts from the static routing table, on the device: every token of the step is
looked up in the table (the file the router reads, [L, V, k]) from the step's own input tokens, decodes fed from
the step before's argmax included. The prefetch then needs nothing from the host, and a step launched before the
one ahead is collected predicts for its real input token, which the router learns only a step later. Reference:
numpy ``hints[l, t*W + j] = table[l, token(t), j]`` for a real token t, j < k and an entry that is not NO_EXPERT,
-1 elsewhere (tests/expert_service/kernels/test_table_hints.py).

  ids [T] int32             the step's staged token ids
  feed [T] int32            the row of `fed` holding token t's id, or -1 (ids[t] is it)
  fed [R] int32             the step before's argmax ids (decodes fed on the device)
  slot_mapping [T] int32    token t's KV slot; -1 marks a padding token, which predicts nothing
  table [L, V, k] uint16    per MoE layer and token id, the experts predicted; NO_EXPERT (0xFFFF, a version-3
                            table's "no prediction", common/routing_table.py) predicts nothing: -1, as a
                            padding token's entries (the prefetch skips -1)
  hints [L, >= T*W] int32   out: each row's first T*W entries written, token-major, W >= k entries a token (the
                            model's top-k, or the table's k when it predicts more)

A token id outside [0, V) predicts nothing (the embedding never reads one: the engine validates ids).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from common.routing_plan import NO_EXPERT
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR

THREADS = 32 if SIMULATOR else 256
MAX_BLOCKS = 4 if SIMULATOR else 1024  # grid-stride past this: a 2,048-token step of 48 layers is 786k entries


@cached_jit
def _table_hints_kernel(ids, feed, fed, slot_mapping, table, hints, T, W):
    """Module docstring: one thread per (layer, token, rank) entry, grid-stride."""
    L, V, k = table.shape[0], table.shape[1], table.shape[2]
    per_layer = T * W
    for i in range(cuda.grid(1), L * per_layer, cuda.gridsize(1)):
        layer = i // per_layer
        entry = i - layer * per_layer
        t = entry // W
        j = entry - t * W
        expert = -1
        if j < k and slot_mapping[t] >= 0:
            token = ids[t]
            if feed[t] >= 0:
                token = fed[feed[t]]
            if token >= 0 and token < V:
                predicted = table[layer, token, j]
                if predicted != NO_EXPERT:
                    expert = np.int32(predicted)
        hints[layer, entry] = expert


def launch_table_hints(ids, feed, fed, slot_mapping, table, hints, W: int, stream=0) -> None:
    """ids, feed, slot_mapping [T], fed [R] int32; table [L, V, k] uint16; hints [L, >= T*W] int32, W >= k
    (module docstring). T == 0 launches nothing."""
    T = ids.shape[0]
    for name, a in (("ids", ids), ("feed", feed), ("fed", fed), ("slot_mapping", slot_mapping)):
        if a.dtype != np.int32 or a.ndim != 1 or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous 1-d int32, got {a.dtype} {list(a.shape)}")
    if feed.shape[0] != T or slot_mapping.shape[0] != T:
        raise ValueError(f"feed {feed.shape[0]} / slot_mapping {slot_mapping.shape[0]} rows differ from {T} ids")
    if table.dtype != np.uint16 or table.ndim != 3 or not table.flags["C_CONTIGUOUS"]:
        raise ValueError(f"table must be C-contiguous [L, V, k] uint16, got {table.dtype} {list(table.shape)}")
    if not 1 <= table.shape[2] <= W:
        raise ValueError(f"the table predicts {table.shape[2]} experts a token, the hints hold {W}")
    L = table.shape[0]
    if hints.dtype != np.int32 or hints.ndim != 2 or hints.shape[0] != L or hints.shape[1] < T * W:
        raise ValueError(f"hints must be int32 [{L}, >= {T * W}], got {hints.dtype} {list(hints.shape)}")
    if T == 0 or L == 0:
        return
    blocks = min(-(-L * T * W // THREADS), MAX_BLOCKS)
    _table_hints_kernel[blocks, THREADS, stream](ids, feed, fed, slot_mapping, table, hints, np.int64(T), np.int64(W))


def sm90_signatures():
    """(python function, numba signature) of the kernel, for the sm_90 compile check."""
    i1 = types.int32[::1]
    return [
        (
            _table_hints_kernel.py_func,
            (i1, i1, i1, i1, types.uint16[:, :, ::1], types.int32[:, ::1], types.int64, types.int64),
        )
    ]
