"""Greedy decoding over lm_head logits: ids[s] = argmax_v logits[s, v] (ties -> lowest index, like
numpy.argmax) and flags[s] = 1 if row s holds any NaN or +-inf (the request then fails with
NON_FINITE_LOGITS), else 0. NaNs never win the argmax; an all -inf/NaN row gives id 0.

One block per row; each thread scans a strided slice keeping (best value, lowest index), then a shared-memory
tree reduction over the block (no warp shuffles, so the same code runs in the simulator). V=152k per row
-> ~600 loads per thread at 256 threads: bandwidth-bound, the reduction is noise.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit

THREADS = 256      # power of two (tree reduction); at most MAX_THREADS
MAX_THREADS = 1024


def argmax_kernel(logits, ids, flags):
    """logits: [S, V] float32. ids: [S] int32 out. flags: [S] int32 out (1 = non-finite value in the row).
    Grid (S,), block (THREADS,) with THREADS a power of two."""
    best_v = cuda.shared.array(MAX_THREADS, dtype=np.float32)
    best_i = cuda.shared.array(MAX_THREADS, dtype=np.int32)
    bad = cuda.shared.array(MAX_THREADS, dtype=np.int32)
    s = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    vocab = logits.shape[1]
    bv = -np.float32(np.inf)
    bi = np.int32(vocab)
    nonfinite = np.int32(0)
    for v in range(tid, vocab, cuda.blockDim.x):
        x = logits[s, v]
        if not math.isfinite(x):
            nonfinite = np.int32(1)
        if x > bv or (x == bv and v < bi):
            bv = x
            bi = np.int32(v)
    best_v[tid] = bv
    best_i[tid] = bi
    bad[tid] = nonfinite
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            ov = best_v[tid + stride]
            oi = best_i[tid + stride]
            if ov > best_v[tid] or (ov == best_v[tid] and oi < best_i[tid]):
                best_v[tid] = ov
                best_i[tid] = oi
            bad[tid] = max(bad[tid], bad[tid + stride])
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        ids[s] = best_i[0] if best_i[0] < vocab else 0
        flags[s] = bad[0]


_argmax = cached_jit(argmax_kernel)


def launch_greedy(logits, ids, flags, stream=0, threads=THREADS) -> None:
    """logits: [S, V] float32 device array; ids: [S] int32, written with the argmax per row; flags: [S] int32,
    written 1 where the row has a non-finite logit, else 0."""
    assert logits.ndim == 2 and logits.dtype == np.float32, (logits.shape, logits.dtype)
    assert ids.shape == flags.shape == (logits.shape[0],), (ids.shape, flags.shape, logits.shape)
    assert ids.dtype == flags.dtype == np.int32, (ids.dtype, flags.dtype)
    assert threads & (threads - 1) == 0 and 32 <= threads <= MAX_THREADS, threads
    for a in (logits, ids, flags):
        assert a.flags["C_CONTIGUOUS"], "greedy needs contiguous arrays"
    if logits.shape[0] == 0:
        return
    _argmax[logits.shape[0], threads, stream](logits, ids, flags)


def sm90_signatures():
    """(python function, numba signature) for the sm_90 compile check."""
    return [(argmax_kernel, (types.float32[:, ::1], types.int32[::1], types.int32[::1]))]
