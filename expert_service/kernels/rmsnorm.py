"""RMSNorm, HF numerics (numpy reference: expert_service.cpu.layers.norm.rms_norm):
out = (x / sqrt(mean(x^2) + eps)) * weight, mean of squares accumulated in float32.

rmsnorm:     out[r] = rmsnorm(x[r]) for rows of x [R, N]; per-head q/k norm views [T, H, Hd] as [T*H, Hd].
add_rmsnorm: residual[r] += delta[r]; out[r] = rmsnorm(residual[r]) -- fuses the residual add of the
             decoder layer into the norm's first read (one pass over residual/delta instead of two).

One block per row, threads striding over N (coalesced), a block reduction (warp shuffles + 32-slot shared
partials) for the sum of squares; the second pass re-reads the row (L1/L2 hit: a row is at most 16 KB).
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.numeric import WARP, block_sum, widener
from expert_service.kernels.jit_cache import cached_jit

THREADS = 256   # 8 warps; N=4096 -> 16 elements per thread, N=128 (head norm) -> most threads idle but cheap


@functools.lru_cache(maxsize=None)
def _build(weight_dtype):
    widen = widener(weight_dtype)

    def rmsnorm_kernel(x, weight, eps, out):
        """x: [R, N] float32. weight: [N] W. eps: float32. out: [R, N] float32 (may alias x).
        Grid (R,), block (THREADS,)."""
        r = cuda.blockIdx.x
        n = x.shape[1]
        ss = np.float32(0.0)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            v = x[r, i]
            ss += v * v
        denom = math.sqrt(block_sum(ss) / np.float32(n) + eps)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            out[r, i] = (x[r, i] / denom) * widen(weight[i])

    def add_rmsnorm_kernel(residual, delta, weight, eps, out):
        """residual: [R, N] float32, updated in place (+= delta). delta: [R, N] float32. weight: [N] W.
        eps: float32. out: [R, N] float32 = rmsnorm(updated residual). Grid (R,), block (THREADS,)."""
        r = cuda.blockIdx.x
        n = residual.shape[1]
        ss = np.float32(0.0)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            v = residual[r, i] + delta[r, i]
            residual[r, i] = v
            ss += v * v
        denom = math.sqrt(block_sum(ss) / np.float32(n) + eps)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):   # same thread wrote residual[r, i]: no sync
            out[r, i] = (residual[r, i] / denom) * widen(weight[i])

    return (rmsnorm_kernel, cached_jit(rmsnorm_kernel)), (add_rmsnorm_kernel, cached_jit(add_rmsnorm_kernel))


def _check(rows, weight, out, threads):
    assert rows.ndim == 2 and rows.dtype == np.float32 and out.shape == rows.shape, (rows.shape, out.shape)
    assert out.dtype == np.float32 and weight.shape == (rows.shape[1],), (out.dtype, weight.shape)
    assert weight.dtype in (np.float32, np.float16, np.uint16), weight.dtype
    assert threads % 32 == 0 and 0 < threads <= 1024, threads
    for a in (rows, weight, out):
        assert a.flags["C_CONTIGUOUS"], "rmsnorm needs contiguous arrays"


def row_threads(n: int) -> int:
    """Threads for rows of n elements: THREADS, or for shorter rows (per-head q/k norms) one per element rounded up
    to whole warps. Each element then sits in the same lane of the same warp as with THREADS threads and the
    missing warps would only have added zeros to the block sum, so the result is the same bit for bit; the
    blocks are smaller and more of them fit an SM."""
    return min(THREADS, -(-n // WARP) * WARP)


def launch_rmsnorm(x, weight, eps, out, stream=0, threads=None) -> None:
    """x: [R, N] float32 (or [T, H, Hd], normalised per head over Hd); weight: [N] float32/float16/uint16
    (bfloat16 bits); eps: float; out: same shape as x, float32, written (may be x itself); threads: per block
    (default `row_threads(N)`)."""
    n = x.shape[x.ndim - 1]                      # (the simulator's shape tuple rejects negative indices)
    threads = threads or row_threads(n)
    assert out.shape == x.shape, (x.shape, out.shape)
    x2, out2 = x.reshape(x.size // n, n), out.reshape(x.size // n, n)
    _check(x2, weight, out2, threads)
    if x2.shape[0] == 0:
        return
    _build(np.dtype(weight.dtype))[0][1][x2.shape[0], threads, stream](x2, weight, np.float32(eps), out2)


def launch_add_rmsnorm(residual, delta, weight, eps, out, stream=0, threads=THREADS) -> None:
    """residual: [R, N] float32, += delta in place; delta: [R, N] float32; weight: [N] W; eps: float;
    out: [R, N] float32 = rmsnorm(residual after the add). out must not alias residual or delta."""
    _check(residual, weight, out, threads)
    assert delta.shape == residual.shape and delta.dtype == np.float32 and delta.flags["C_CONTIGUOUS"]
    if residual.shape[0] == 0:
        return
    _build(np.dtype(weight.dtype))[1][1][residual.shape[0], threads, stream](residual, delta, weight,
                                                                            np.float32(eps), out)


def sm90_signatures():
    """(python function, numba signature) of each weight-dtype variant, for the sm_90 compile check."""
    f2 = types.float32[:, ::1]
    out = []
    for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        (norm, _), (add_norm, _) = _build(np.dtype(dt))
        out.append((norm, (f2, nb[::1], types.float32, f2)))
        out.append((add_norm, (f2, f2, nb[::1], types.float32, f2)))
    return out
