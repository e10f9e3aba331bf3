"""Weighted combine of the grouped expert outputs, fused with the residual add; reference:
``expert_service.experts.grouping.combine`` followed by ``h + ...``.

Grid (T, Y): the Y blocks of a token stride together over D (Y = 1 for large steps; small steps spread a
token's row over up to one element per thread, `numeric.blocks_per_row`: with one block a decode token's 2048 elements x
8 experts took 8 serial rounds of dependent loads, ~19 µs on the H200). Each output element is written by exactly
one thread and its K terms are summed in slot order, so the result is deterministic (no atomics) and does not
depend on Y.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import SIMULATOR, blocks_per_row

THREADS = 32 if SIMULATOR else 256    # the simulator pays per thread; the indexing is the same


@functools.cache
def _build(top_k: int, mode: int = 0):
    prologue = programmatic.prologue(mode)  # kernels/programmatic.py

    def moe_combine_kernel(y, position, weights, h):
        """y [T*K, D] f32 grouped expert outputs, position [T*K] int32 (grouped position of assignment t*K+k),
        weights [T, K] f32 -> h [T, D] f32 updated in place: h[t] += sum_k weights[t, k] * y[position[t*K+k]].
        K = top_k is a compile-time constant: rows and weights in registers, the K loads of an element issue
        together."""
        prologue()
        t = cuda.blockIdx.x
        width = h.shape[1]
        rows = cuda.local.array(top_k, np.int32)
        w = cuda.local.array(top_k, np.float32)
        for k in range(top_k):
            rows[k] = position[t * top_k + k]
            w[k] = weights[t, k]
        for d in range(cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x, width,
                       cuda.gridDim.y * cuda.blockDim.x):
            acc = np.float32(0.0)
            for k in range(top_k):
                acc += w[k] * y[rows[k], d]
            h[t, d] += acc

    return moe_combine_kernel, programmatic.compiled(moe_combine_kernel, mode)


def launch_moe_combine(y, position, weights, h, stream=0) -> None:
    """y [T*K, D] f32, position [T*K] int32, weights [T, K] f32, h [T, D] f32 (all device; h updated in place)."""
    n_tok, top_k = weights.shape
    width = h.shape[1]
    expected = {"y": (n_tok * top_k, width), "position": (n_tok * top_k,), "weights": (n_tok, top_k),
                "h": (n_tok, width)}
    for name, a, dt in (("y", y, np.float32), ("position", position, np.int32), ("weights", weights, np.float32),
                        ("h", h, np.float32)):
        if a.shape != expected[name] or a.dtype != dt or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous {np.dtype(dt).name} {list(expected[name])}, "
                             f"got {a.dtype} {list(a.shape)}")
    if n_tok:
        kernel = _build(int(top_k), programmatic.mode())[1]
        kernel[(n_tok, blocks_per_row(n_tok, width, THREADS)), THREADS, stream](y, position, weights, h)


def sm90_signatures():
    """(python function, numba signature) of every kernel variant, for the sm_90 compile check."""
    f2 = types.float32[:, ::1]
    # mixtral's, qwen2-moe's, qwen3's top-k; qwen3's waiting too
    return [(_build(k, w)[0], (f2, types.int32[::1], f2, f2)) for k, w in ((2, False), (4, False), (8, False), (8, True))]
