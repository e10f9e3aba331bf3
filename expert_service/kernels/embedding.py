"""Embedding gather: out[t, :] = W[ids[t], :] widened to float32 (numpy reference: ``W[ids]`` as in
expert_service.cpu.decoder.CpuDecoder.forward).

One block per token, threads striding over D: each token's table row is one contiguous run, so the reads
of W and the writes of out are coalesced; the op is pure bandwidth (T*D elements).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.numeric import widener
from expert_service.kernels.jit_cache import cached_jit

THREADS = 128   # 4 warps; D=4096 -> 32 elements per thread


@functools.lru_cache(maxsize=None)
def _build(weight_dtype):
    widen = widener(weight_dtype)

    def embedding_kernel(ids, table, out):
        """ids: [T] int32 token ids (0 <= id < V). table: [V, D] W. out: [T, D] float32.
        Grid (T,), block (THREADS,)."""
        t = cuda.blockIdx.x
        row = ids[t]
        for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
            out[t, d] = widen(table[row, d])

    return embedding_kernel, cached_jit(embedding_kernel)


def launch_embedding(ids, table, out, stream=0, threads=THREADS) -> None:
    """ids: [T] int32 device array (ids must be < V; not checked on the device); table: [V, D] device array
    of float32, float16 or uint16 (bfloat16 bits); out: [T, D] float32, written."""
    assert ids.ndim == 1 and ids.dtype == np.int32, (ids.shape, ids.dtype)
    assert table.ndim == 2 and out.shape == (ids.shape[0], table.shape[1]), (table.shape, out.shape)
    assert out.dtype == np.float32 and table.dtype in (np.float32, np.float16, np.uint16), (out.dtype, table.dtype)
    assert threads % 32 == 0 and 0 < threads <= 1024, threads
    for a in (ids, table, out):
        assert a.flags["C_CONTIGUOUS"], "embedding needs contiguous arrays"
    if ids.shape[0] == 0:
        return
    _build(np.dtype(table.dtype))[1][ids.shape[0], threads, stream](ids, table, out)


def sm90_signatures():
    """(python function, numba signature) of each weight-dtype variant, for the sm_90 compile check."""
    return [(_build(np.dtype(dt))[0], (types.int32[::1], nb[:, ::1], types.float32[:, ::1]))
            for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16))]
