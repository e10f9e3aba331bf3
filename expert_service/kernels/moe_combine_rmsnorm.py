"""The MoE layer's combine and residual add fused with the next layer's input RMSNorm: one launch where the
decoder ran `moe_combine` (or `moe_combine_dense`) and then `rmsnorm` (numpy reference:
``expert_service.experts.grouping.combine`` + ``h + ...``, then ``expert_service.cpu.layers.norm.rms_norm``).

    h[t, d] += sum_k weights[t, k] * y[row(t, k), d]      row: position[t*K + k] of y [T*K, D] (grouped layout)
                                                           or y[ids[t, k], t] of y [E, T, D] (dense layout)
    out[t]   = h[t] / sqrt(mean(h[t]^2) + eps) * norm_weight

This is `rmsnorm.add_rmsnorm` (residual add, then the norm of the updated row) with the delta computed on the fly
from the expert outputs: every residual add of the decoder is already fused into the op that produces it (GEMV /
cuBLAS accumulate, `moe_combine`), so the add + norm fusion that removes a launch is the combine's, not a
separate delta buffer. One block per token, thread j holding elements j, j + threads, ... as rmsnorm's block kernel.
Bitwise the same as the unfused pair: each h element sums its K terms in slot order as `moe_combine[_dense]`
does, and the sum of squares runs over the same `rmsnorm.THREADS`-thread partition and block reduction as
`rmsnorm`, so graph replay, eager steps and the unfused path agree bit for bit.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import block_sum, widener
from expert_service.kernels.rmsnorm import THREADS, per_thread  # rmsnorm's partition: bitwise-equal norms


@functools.cache
def _build(weight_dtype, dense: bool, top_k: int, per_thread: int):
    widen = widener(weight_dtype)

    @cuda.jit(device=True, inline=True)
    def grouped_row(index, t, k):
        return index[t * top_k + k]

    @cuda.jit(device=True, inline=True)
    def dense_row(index, t, k):
        return index[t, k]

    @cuda.jit(device=True, inline=True)
    def grouped_value(y, row, t, d):
        return y[row, d]

    @cuda.jit(device=True, inline=True)
    def dense_value(y, row, t, d):
        return y[row, t, d]

    row_of, value = (dense_row, dense_value) if dense else (grouped_row, grouped_value)

    def moe_combine_rmsnorm_kernel(y, index, weights, h, norm_weight, eps, out):
        """y: [T*K, D] float32 (grouped) or [E, T, D] float32 (dense). index: position [T*K] int32 (grouped) or
        ids [T, K] int32 (dense). weights: [T, K] float32. h: [T, D] float32 residual, updated in place.
        norm_weight: [D] W. eps: float32. out: [T, D] float32 = rmsnorm(updated h). Grid (T,), block (threads,)
        with D <= per_thread * threads. K and per_thread are compile-time constants: the token's rows and
        weights sit in registers, and a thread's K x per_thread loads of y (with its h and norm weights) issue
        before the first store (a runtime count kept them one dependent round trip each)."""
        t = cuda.blockIdx.x
        width = h.shape[1]
        rows = cuda.local.array(top_k, np.int32)
        w = cuda.local.array(top_k, np.float32)
        for k in range(top_k):
            rows[k] = row_of(index, t, k)
            w[k] = weights[t, k]
        v = cuda.local.array(per_thread, np.float32)
        nw = cuda.local.array(per_thread, np.float32)
        for j in range(per_thread):
            d = cuda.threadIdx.x + j * cuda.blockDim.x
            if d < width:
                acc = np.float32(0.0)
                for k in range(top_k):
                    acc += w[k] * value(y, rows[k], t, d)
                v[j] = h[t, d] + acc
                nw[j] = widen(norm_weight[d])
            else:
                v[j] = np.float32(0.0)
                nw[j] = np.float32(0.0)
        ss = np.float32(0.0)
        for j in range(per_thread):   # element order, as rmsnorm's block kernel
            d = cuda.threadIdx.x + j * cuda.blockDim.x
            if d < width:
                h[t, d] = v[j]
            ss += v[j] * v[j]
        denom = math.sqrt(block_sum(ss) / np.float32(width) + eps)
        for j in range(per_thread):
            d = cuda.threadIdx.x + j * cuda.blockDim.x
            if d < width:
                out[t, d] = (v[j] / denom) * nw[j]

    return moe_combine_rmsnorm_kernel, cached_jit(moe_combine_rmsnorm_kernel)


def launch_moe_combine_rmsnorm(y, index, weights, h, norm_weight, eps, out, dense: bool = False,
                               stream=0, threads=THREADS) -> None:
    """Grouped layout (dense=False): y [T*K, D] float32, index = position [T*K] int32 (row of assignment t*K+k);
    dense layout (dense=True): y [E, T, D] float32, index = ids [T, K] int32. weights: [T, K] float32; h: [T, D]
    float32, += the weighted expert outputs in place; norm_weight: [D] float32/float16/uint16 (bfloat16 bits);
    eps: float; out: [T, D] float32 = rmsnorm(h after the add), written (must not alias h or y). threads:
    bitwise equal to `rmsnorm` launched with the same count (both default to rmsnorm.THREADS)."""
    num_tokens, top_k = weights.shape
    width = h.shape[1]
    if dense:
        assert y.ndim == 3 and y.shape[1:] == h.shape and index.shape == (num_tokens, top_k), (y.shape, index.shape)
    else:
        assert y.shape == (num_tokens * top_k, width) and index.shape == (num_tokens * top_k,), (y.shape, index.shape)
    assert y.dtype == weights.dtype == h.dtype == out.dtype == np.float32 and index.dtype == np.int32
    assert out.shape == h.shape and norm_weight.shape == (width,), (out.shape, norm_weight.shape)
    assert norm_weight.dtype in (np.float32, np.float16, np.uint16), norm_weight.dtype
    assert threads % 32 == 0 and 0 < threads <= 1024, threads
    for a in (y, index, weights, h, norm_weight, out):
        assert a.flags["C_CONTIGUOUS"], "moe_combine_rmsnorm needs contiguous arrays"
    if num_tokens == 0:
        return
    kernel = _build(np.dtype(norm_weight.dtype), bool(dense), int(top_k), per_thread(width, threads))[1]
    kernel[num_tokens, threads, stream](y, index, weights, h, norm_weight, np.float32(eps), out)


def sm90_signatures():
    """(python function, numba signature) of each layout and norm-weight dtype, for the sm_90 compile check."""
    f2, f3 = types.float32[:, ::1], types.float32[:, :, ::1]
    out = []
    for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        for k, per in ((2, 16), (4, 8), (8, 8)):   # mixtral's, qwen2-moe's and qwen3's top-k and hidden sizes
            out.append((_build(np.dtype(dt), False, k, per)[0],
                        (f2, types.int32[::1], f2, f2, nb[::1], types.float32, f2)))
            out.append((_build(np.dtype(dt), True, k, per)[0],
                        (f3, types.int32[:, ::1], f2, f2, nb[::1], types.float32, f2)))
    return out
