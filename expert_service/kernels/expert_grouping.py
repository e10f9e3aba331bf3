"""Counting sort of the step's (token, slot) assignments by expert, on the device; reference:
``expert_service.experts.grouping.group_by_expert``.

One block does the whole sort in a single launch, so nothing needs zeroing beforehand and no value goes back
to the host (CUDA-graph capturable): histogram with shared-memory atomics, exclusive scan of the E counts, then
placement through per-expert shared cursors. The order of assignments *within* an expert depends on atomic
arrival order (not stable, unlike the reference); a token's result never depends on it, because the combine
reads each assignment's output through ``position``.

Why one block: T*K is at most 65536 (512-token prefill x K=8 is 4096), a few passes over it from one SM take
microseconds, and a multi-block version would need a zeroing launch plus a grid-wide barrier. The cost that
grows is same-address atomic contention when every assignment hits one expert (serialised shared atomics);
warp-aggregated atomics (``match_any_sync``) would cut that if it ever shows up in a profile.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR

MAX_E = 256
MAX_ASSIGNMENTS = 65536
# The simulator runs a Python thread per CUDA thread, so it uses a small block; the code path is the same.
THREADS = 64 if SIMULATOR else 1024
_SCAN_SLOTS = 1024          # >= THREADS


@cached_jit
def _expert_grouping_kernel(ids, counts, offsets, order, position):
    """ids [T, K] int32 in [0, E) -> counts [E], offsets [E+1], order [T*K], position [T*K] (all int32).

    order[p] = flat assignment index t*K+k at grouped position p; position[t*K+k] = p (inverse permutation).
    Ids outside [0, E) are dropped (launch_gate_topk never produces them); they would leave holes in order.
    """
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n_exp = counts.shape[0]
    top_k = ids.shape[1]
    n = ids.shape[0] * top_k
    hist = cuda.shared.array(MAX_E, np.int32)
    cursor = cuda.shared.array(MAX_E, np.int32)
    partial = cuda.shared.array(_SCAN_SLOTS, np.int32)

    for e in range(tid, n_exp, nthreads):
        hist[e] = 0
    cuda.syncthreads()
    for i in range(tid, n, nthreads):
        e = ids[i // top_k, i % top_k]
        if 0 <= e < n_exp:
            cuda.atomic.add(hist, e, 1)
    cuda.syncthreads()

    # Exclusive scan: each thread sums a contiguous chunk of counts, a Hillis-Steele scan over the thread
    # totals gives each chunk's start, then the thread writes its chunk's offsets.
    chunk = (n_exp + nthreads - 1) // nthreads
    lo = min(tid * chunk, n_exp)
    hi = min(lo + chunk, n_exp)
    own = 0
    for e in range(lo, hi):
        own += hist[e]
    partial[tid] = own
    cuda.syncthreads()
    step = 1
    while step < nthreads:
        v = partial[tid - step] if tid >= step else 0
        cuda.syncthreads()
        partial[tid] += v
        cuda.syncthreads()
        step *= 2
    run = partial[tid] - own
    for e in range(lo, hi):
        c = hist[e]
        counts[e] = c
        offsets[e] = run
        cursor[e] = run
        run += c
    if tid == nthreads - 1:
        offsets[n_exp] = partial[tid]
    cuda.syncthreads()

    for i in range(tid, n, nthreads):
        e = ids[i // top_k, i % top_k]
        if 0 <= e < n_exp:
            p = cuda.atomic.add(cursor, e, 1)
            order[p] = i
            position[i] = p


def launch_expert_grouping(ids, counts, offsets, order, position, stream=0) -> None:
    """ids [T, K] int32 (device); writes counts [E], offsets [E+1], order [T*K], position [T*K] (int32, device)."""
    n_tok, top_k = ids.shape
    n_exp = counts.shape[0]
    n = n_tok * top_k
    if not 1 <= n_exp <= MAX_E or n > MAX_ASSIGNMENTS:
        raise ValueError(f"expert_grouping supports E <= {MAX_E} and T*K <= {MAX_ASSIGNMENTS}, got E={n_exp} T*K={n}")
    expected = {"ids": (n_tok, top_k), "counts": (n_exp,), "offsets": (n_exp + 1,), "order": (n,), "position": (n,)}
    for name, a in (("ids", ids), ("counts", counts), ("offsets", offsets), ("order", order), ("position", position)):
        if a.shape != expected[name] or a.dtype != np.int32 or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous int32 {list(expected[name])}, got {a.dtype} {list(a.shape)}")
    _expert_grouping_kernel[1, THREADS, stream](ids, counts, offsets, order, position)


def sm90_signatures():
    """(python function, numba signature) of every kernel variant, for the sm_90 compile check."""
    i32 = types.int32[::1]
    return [(_expert_grouping_kernel.py_func, (types.int32[:, ::1], i32, i32, i32, i32))]
