"""Greedy argmax over wide vocabularies in two passes: the same results as `greedy.launch_greedy`
(ids[s] = argmax_v logits[s, v], ties -> lowest index, NaN never wins, an all -inf/NaN row gives 0;
flags[s] = 1 if the row holds a NaN or +-inf), for rows too wide for one block to read quickly
(152k logits per row: one block reads it at a fraction of HBM bandwidth; docs/kernels.md has the figure).

Pass 1: grid S x P blocks, block (s, p) reduces the slice [p * CHUNK, (p + 1) * CHUNK) of row s (each thread
loads ITEMS values, coalesced, all in flight before the first compare) to (value, lowest index, non-finite)
in part_values / part_ids / part_flags [S, P]. Pass 2: one block per row reduces its P partials in ascending
slice order. Both use shared-memory tree reductions (the same code runs in the simulator). No atomics, no
buffer that needs zeroing: graph-capturable and deterministic. P = parts(V) (75 for V = 151936).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import SIMULATOR

THREADS = 32 if SIMULATOR else 256       # power of two (tree reductions)
ITEMS = 2 if SIMULATOR else 8
CHUNK = THREADS * ITEMS                  # logits per pass-1 block
FINAL_THREADS = 32 if SIMULATOR else 128   # power of two


def parts(vocab: int) -> int:
    """Pass-1 blocks per row (the P of the partial buffers)."""
    return max(1, -(-vocab // CHUNK))


@cuda.jit(device=True, inline=True)
def _better(v, i, bv, bi):
    return v > bv or (v == bv and i < bi)


@cuda.jit(device=True, inline=True)
def _tree(best_v, best_i, bad, tid):
    """Reduce the block's posts in place to slot 0 (blockDim a power of two)."""
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            ov = best_v[tid + stride]
            oi = best_i[tid + stride]
            if _better(ov, oi, best_v[tid], best_i[tid]):
                best_v[tid] = ov
                best_i[tid] = oi
            bad[tid] = max(bad[tid], bad[tid + stride])
        cuda.syncthreads()
        stride //= 2


@functools.cache
def _kernels(mode: int = 0):
    """(parts python kernel, jitted, final python kernel, jitted); mode: the
    programmatic-launch variant (kernels/programmatic.py)."""
    prologue = programmatic.prologue(mode)

    def _argmax_parts_kernel(logits, part_values, part_ids, part_flags):
        """logits [S, V] f32 -> part_values [S, P] f32, part_ids [S, P] int32 (V where the slice has no candidate),
        part_flags [S, P] int32. Grid (S * P,), block (THREADS,)."""
        prologue()
        best_v = cuda.shared.array(THREADS, np.float32)
        best_i = cuda.shared.array(THREADS, np.int32)
        bad = cuda.shared.array(THREADS, np.int32)
        n_parts = part_values.shape[1]
        s = cuda.blockIdx.x // n_parts
        p = cuda.blockIdx.x % n_parts
        tid = cuda.threadIdx.x
        vocab = logits.shape[1]
        start = p * CHUNK + tid
        vals = cuda.local.array(ITEMS, np.float32)
        for j in range(ITEMS):                 # every load issued before the first compare
            v = start + j * THREADS
            vals[j] = logits[s, v] if v < vocab else np.float32(-np.inf)
        bv = -np.float32(np.inf)
        bi = np.int32(vocab)
        nonfinite = np.int32(0)
        for j in range(ITEMS):
            v = start + j * THREADS
            x = vals[j]
            if v < vocab:
                if not math.isfinite(x):
                    nonfinite = np.int32(1)
                if _better(x, np.int32(v), bv, bi):    # ascending v per thread: > keeps the lowest index
                    bv = x
                    bi = np.int32(v)
        best_v[tid] = bv
        best_i[tid] = bi
        bad[tid] = nonfinite
        _tree(best_v, best_i, bad, tid)
        if tid == 0:
            part_values[s, p] = best_v[0]
            part_ids[s, p] = best_i[0]
            part_flags[s, p] = bad[0]


    def _argmax_final_kernel(part_values, part_ids, part_flags, vocab, ids, flags):
        """Reduce each row's P partials -> ids [S], flags [S] int32. Grid (S,), block (FINAL_THREADS,)."""
        prologue()
        best_v = cuda.shared.array(FINAL_THREADS, np.float32)
        best_i = cuda.shared.array(FINAL_THREADS, np.int32)
        bad = cuda.shared.array(FINAL_THREADS, np.int32)
        s = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        bv = -np.float32(np.inf)
        bi = np.int32(vocab)
        nonfinite = np.int32(0)
        for p in range(tid, part_values.shape[1], cuda.blockDim.x):
            if _better(part_values[s, p], part_ids[s, p], bv, bi):
                bv = part_values[s, p]
                bi = part_ids[s, p]
            nonfinite = max(nonfinite, part_flags[s, p])
        best_v[tid] = bv
        best_i[tid] = bi
        bad[tid] = nonfinite
        _tree(best_v, best_i, bad, tid)
        if tid == 0:
            ids[s] = best_i[0] if best_i[0] < vocab else 0
            flags[s] = bad[0]

    return (
        _argmax_parts_kernel,
        programmatic.compiled(_argmax_parts_kernel, mode),
        _argmax_final_kernel,
        programmatic.compiled(_argmax_final_kernel, mode),
    )


def launch_greedy_split(logits, ids, flags, part_values, part_ids, part_flags, stream=0) -> None:
    """logits [S, V] f32; ids, flags [S] int32 (written); part_values [S, P] f32, part_ids / part_flags [S, P]
    int32 scratch with P = parts(V) (a workspace of the largest S)."""
    rows, vocab = logits.shape
    p = parts(vocab)
    for name, a, shape, dt in (("logits", logits, (rows, vocab), np.float32), ("ids", ids, (rows,), np.int32),
                               ("flags", flags, (rows,), np.int32),
                               ("part_values", part_values, (rows, p), np.float32),
                               ("part_ids", part_ids, (rows, p), np.int32),
                               ("part_flags", part_flags, (rows, p), np.int32)):
        if a.shape != shape or a.dtype != dt or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous {np.dtype(dt).name} {list(shape)}, got {a.dtype} "
                             f"{list(a.shape)}")
    if rows == 0:
        return
    _, parts_kernel, _, final_kernel = _kernels(programmatic.mode())
    parts_kernel[rows * p, THREADS, stream](logits, part_values, part_ids, part_flags)
    final_kernel[rows, FINAL_THREADS, stream](part_values, part_ids, part_flags, np.int32(vocab), ids, flags)


def sm90_signatures():
    f2, i2, i1 = types.float32[:, ::1], types.int32[:, ::1], types.int32[::1]
    out = []
    for wait in (False, True):
        parts_kernel, _, final_kernel, _ = _kernels(wait)
        out += [(parts_kernel, (f2, f2, i2, i2)), (final_kernel, (f2, i2, i2, types.int32, i1, i1))]
    return out
