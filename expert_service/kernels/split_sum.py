"""The sum of split-K partial results: out [R, N] (+)= partials[0] + partials[1] + ... + partials[S-1], planes added
in that order (a fixed order: the same bits every run, which atomic adds of the splits would not give).

moe_gemm_q8mma splits the input axis of a GEMM whose output has too few tiles to fill the GPU (an 8-bit dense
matrix over a few rows: the attention projections at decode) and writes each split's sums to its own plane.
Reference: ``split_sum_reference``.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import check_array

THREADS = 256


@functools.cache
def _build(accumulate: bool):
    def split_sum_kernel(partials, out):
        """partials [S, R * N] float32, out [R * N] float32. Grid (ceil(R * N / THREADS),)."""
        i = cuda.grid(1)
        if i >= out.shape[0]:
            return
        total = partials[0, i]
        for s in range(1, partials.shape[0]):
            total += partials[s, i]
        if accumulate:
            out[i] += total
        else:
            out[i] = total

    return split_sum_kernel, cached_jit(split_sum_kernel)


def launch_split_sum(partials, out, accumulate: bool = False, stream=0) -> None:
    """partials [S, R, N] float32 (C-contiguous), out [R, N] float32: written, or added to (accumulate)."""
    if partials.ndim != 3:
        raise ValueError(f"partials must be float32 [splits, R, N], got {list(partials.shape)}")
    S, R, N = partials.shape
    check_array("partials", partials, (S, R, N), np.float32)
    check_array("out", out, (R, N), np.float32)
    if S < 1:
        raise ValueError("partials must hold at least one split")
    n = R * N
    if n:
        kernel = _build(bool(accumulate))[1]
        kernel[-(-n // THREADS), THREADS, stream](partials.reshape(S, n), out.reshape(n))


def split_sum_reference(partials: np.ndarray, out: np.ndarray, accumulate: bool) -> np.ndarray:
    """float32 sums in the kernel's order."""
    total = partials[0].astype(np.float32).copy()
    for s in range(1, partials.shape[0]):
        total = total + partials[s]
    return out + total if accumulate else total


def sm90_signatures():
    f1, f2 = types.float32[::1], types.float32[:, ::1]
    return [(_build(accumulate)[0], (f2, f1)) for accumulate in (False, True)]
