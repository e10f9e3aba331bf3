"""Row gather: dst[p, :] = src[index[p] // divisor, :] (float32 source; float32, float16 or bfloat16 dst).

Used to pick each sequence's last row before the LM head (divisor 1, float32) and, on the prefill path, to lay
the step's tokens out in expert-grouped order (index = grouping's `order`, divisor = K) so each expert's tokens
are one contiguous block for a cuBLAS GEMM -- there straight into the weights' 16-bit dtype, which is the cast
the GEMM needs (round to nearest even for bfloat16). Numpy reference: ``src[index // divisor]`` (rounded).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import blocks_per_row, storer

THREADS = 128
DST_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16))


@functools.cache
def _build(dst_dtype, mode: int = 0):
    store = storer(dst_dtype)
    prologue = programmatic.prologue(mode)  # kernels/programmatic.py

    def gather_rows_kernel(src, index, divisor, dst):
        """src [R, D] f32, index [n] int32, divisor int32, dst [n * D] flat, of dst_dtype. Grid (n, Y),
        block (THREADS,): the Y blocks of a row stride together over D (numeric.blocks_per_row)."""
        prologue()
        p = cuda.blockIdx.x
        row = index[p] // divisor
        width = src.shape[1]
        first, step = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x, cuda.gridDim.y * cuda.blockDim.x
        for d in range(first, width, step):
            store(dst, p * width + d, src[row, d])

    return gather_rows_kernel, programmatic.compiled(gather_rows_kernel, mode)


def launch_gather_rows(src, index, dst, divisor: int = 1, stream=0) -> None:
    """src: [R, D] float32; index: [n] int32 (index // divisor < R, not checked on the device);
    dst: [n, D] C-contiguous float32, float16 or uint16 (bfloat16 bits), written (rounded to its dtype)."""
    assert src.ndim == 2 and dst.shape == (index.shape[0], src.shape[1]), (src.shape, index.shape, dst.shape)
    assert src.dtype == np.float32 and np.dtype(dst.dtype) in DST_DTYPES, (src.dtype, dst.dtype)
    assert index.dtype == np.int32 and divisor >= 1 and dst.flags["C_CONTIGUOUS"]
    n = index.shape[0]
    if n:
        grid = (n, blocks_per_row(n, src.shape[1], THREADS))
        _build(np.dtype(dst.dtype), programmatic.mode())[1][grid, THREADS, stream](src, index, np.int32(divisor), dst.reshape(-1))


def sm90_signatures():
    out = []
    for (dtype, nb), wait in itertools.product(zip(DST_DTYPES, (types.float32, types.float16, types.uint16)), (False, True)):
        out.append((_build(dtype, wait)[0], (types.float32[:, ::1], types.int32[::1], types.int32, nb[::1])))
    return out
