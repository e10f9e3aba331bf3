"""Combine of the dense-expert path: h[t, :] += sum_k weights[t, k] * y[ids[t, k], t, :].

When a step's tokens reach most experts (decode at batch >= E/K), every expert runs on every token as one
strided-batched GEMM on tensor cores (each expert's weights read once, no host round trip, so it can be
captured in a graph); this kernel keeps only each token's routed experts, with their routing weights.
Deterministic (no atomics). Numpy reference: ``h + np.einsum("tk,tkd->td", weights, y[ids, arange(T)])``.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit

THREADS = 256


@cached_jit
def _combine_dense(y, ids, weights, h):
    """y [E, T, D] f32, ids [T, K] int32, weights [T, K] f32, h [T, D] f32 (+=). Grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    for d in range(cuda.threadIdx.x, h.shape[1], cuda.blockDim.x):
        acc = np.float32(0.0)
        for k in range(ids.shape[1]):
            acc += weights[t, k] * y[ids[t, k], t, d]
        h[t, d] += acc


def launch_moe_combine_dense(y, ids, weights, h, stream=0) -> None:
    """y: [E, T, D] float32 (every expert's output for every token); ids: [T, K] int32; weights: [T, K]
    float32; h: [T, D] float32, updated in place."""
    num_tokens = h.shape[0]
    assert y.ndim == 3 and y.shape[1:] == h.shape and ids.shape == weights.shape and ids.shape[0] == num_tokens
    assert y.dtype == h.dtype == weights.dtype == np.float32 and ids.dtype == np.int32
    if num_tokens:
        _combine_dense[num_tokens, THREADS, stream](y, ids, weights, h)


def sm90_signatures():
    return [(_combine_dense.py_func, (types.float32[:, :, ::1], types.int32[:, ::1], types.float32[:, ::1],
                                      types.float32[:, ::1]))]
