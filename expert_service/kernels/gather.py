"""Row gather: dst[p, :] = src[index[p] // divisor, :] (float32).

Used to pick each sequence's last row before the LM head (divisor 1) and, on the prefill path, to lay the
step's tokens out in expert-grouped order (index = grouping's `order`, divisor = K) so each expert's tokens
are one contiguous block for a cuBLAS GEMM. Numpy reference: ``src[index // divisor]``.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types
from expert_service.kernels.jit_cache import cached_jit

THREADS = 128


@cached_jit
def _gather_rows(src, index, divisor, dst):
    """src [R, D] f32, index [n] int32, divisor int32, dst [n, D] f32. Grid (n,), block (THREADS,)."""
    p = cuda.blockIdx.x
    row = index[p] // divisor
    for d in range(cuda.threadIdx.x, dst.shape[1], cuda.blockDim.x):
        dst[p, d] = src[row, d]


def launch_gather_rows(src, index, dst, divisor: int = 1, stream=0) -> None:
    """src: [R, D] float32; index: [n] int32 (index // divisor < R, not checked on the device);
    dst: [n, D] float32, written."""
    assert src.ndim == 2 and dst.shape == (index.shape[0], src.shape[1]), (src.shape, index.shape, dst.shape)
    assert src.dtype == dst.dtype == np.float32 and index.dtype == np.int32 and divisor >= 1
    if index.shape[0]:
        _gather_rows[index.shape[0], THREADS, stream](src, index, np.int32(divisor), dst)


def sm90_signatures():
    return [(_gather_rows.py_func, (types.float32[:, ::1], types.int32[::1], types.int32, types.float32[:, ::1]))]
