"""Weighted combine of the grouped expert outputs, fused with the residual add; reference:
``expert_service.experts.grouping.combine`` followed by ``h + ...``.

Grid (T, Y): the Y blocks of a token stride together over D (Y = 1 for large steps; small steps spread a
token's row over up to one element per thread, `numeric.blocks_per_row`: with one block a decode token's 2048 elements x
8 experts took 8 serial rounds of dependent loads, ~19 µs on the H200). Each output element is written by exactly
one thread and its K terms are summed in slot order, so the result is deterministic (no atomics) and does not
depend on Y.

With the next layer's input norm (small steps, where moe_combine_rmsnorm's one block a token is slow): each block
fences its part of h and takes a ticket; the last of a token's Y blocks resets it and runs rmsnorm's block body
on the whole row (`rmsnorm.row_norm`), so the pair's bits come out of one launch.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR, blocks_per_row
from expert_service.kernels.rmsnorm import block_threads, per_thread, row_norm

THREADS = 32 if SIMULATOR else 256    # the simulator pays per thread; the indexing is the same


@functools.cache
def _build(top_k: int, norm_dtype=None, per_thread: int = 0):
    """(python kernel, jitted kernel) for top_k slots a token; norm_dtype (the norm weight's dtype) and per_thread
    (rmsnorm.per_thread of D over the block): the variant that also writes the next layer's input norm."""

    @cuda.jit(device=True, inline=True)
    def combine_row(y, position, weights, h):
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

    if norm_dtype is None:
        def moe_combine_kernel(y, position, weights, h):
            """y [T*K, D] f32 grouped expert outputs, position [T*K] int32 (grouped position of assignment t*K+k),
            weights [T, K] f32 -> h [T, D] f32 updated in place: h[t] += sum_k weights[t, k] * y[position[t*K+k]].
            K = top_k is a compile-time constant: rows and weights in registers, the K loads of an element issue
            together."""
            combine_row(y, position, weights, h)

        return moe_combine_kernel, cached_jit(moe_combine_kernel)

    norm_row = row_norm(norm_dtype, per_thread)

    def moe_combine_norm_kernel(y, position, weights, h, norm_weight, eps, out, tickets):
        """moe_combine_kernel's arguments, then norm_weight [D] (float32, float16 or bf16 bits), eps float32,
        out [T, D] f32 = rmsnorm(h[t] after the add) and tickets [>= T] int32 (zero on entry and on exit): the last
        of a token's Y blocks to finish its part of the combine normalises the whole row (rmsnorm's body)."""
        combine_row(y, position, weights, h)
        last = cuda.shared.array(1, types.int32)
        t = cuda.blockIdx.x
        cuda.threadfence()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            ticket = cuda.atomic.add(tickets, t, 1)
            last[0] = 1 if ticket == cuda.gridDim.y - 1 else 0
            if ticket == cuda.gridDim.y - 1:
                tickets[t] = 0
        cuda.syncthreads()
        if last[0] != 0:
            cuda.threadfence()
            norm_row(h, t, norm_weight, eps, out)

    return moe_combine_norm_kernel, cached_jit(moe_combine_norm_kernel)


def launch_moe_combine(y, position, weights, h, stream=0, norm=None) -> None:
    """y [T*K, D] f32, position [T*K] int32, weights [T, K] f32, h [T, D] f32 (all device; h updated in place).
    norm: (norm_weight [D] float32 / float16 / uint16 (bf16 bits), eps, out [T, D] f32, tickets [>= T] int32 all
    zero (a workspace buffer zeroed once: every launch leaves it zero)): out = rmsnorm(h after the add), written
    in the same launch by the last of each token's blocks, on rmsnorm's own thread count (`rmsnorm.block_threads`),
    so the bits of `launch_rmsnorm` after the combine (moe_combine_rmsnorm's one block a token without its serial
    rounds of loads)."""
    n_tok, top_k = weights.shape
    width = h.shape[1]
    expected = {"y": (n_tok * top_k, width), "position": (n_tok * top_k,), "weights": (n_tok, top_k),
                "h": (n_tok, width)}
    arrays = [("y", y, np.float32), ("position", position, np.int32), ("weights", weights, np.float32),
              ("h", h, np.float32)]
    if norm is not None:
        norm_weight, eps, out, tickets = norm
        expected.update(norm_weight=(width,), out=(n_tok, width), tickets=(max(n_tok, tickets.shape[0]),))
        arrays += [("norm_weight", norm_weight, norm_weight.dtype), ("out", out, np.float32),
                   ("tickets", tickets, np.int32)]
        if norm_weight.dtype not in (np.float32, np.float16, np.uint16):
            raise ValueError(f"norm_weight must be float32, float16 or uint16 (bf16 bits), got {norm_weight.dtype}")
    for name, a, dt in arrays:
        if a.shape != expected[name] or a.dtype != dt or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous {np.dtype(dt).name} {list(expected[name])}, "
                             f"got {a.dtype} {list(a.shape)}")
    if not n_tok:
        return
    if norm is None:
        grid = (n_tok, blocks_per_row(n_tok, width, THREADS))
        _build(int(top_k))[1][grid, THREADS, stream](y, position, weights, h)
    else:
        threads = block_threads(width)
        grid = (n_tok, blocks_per_row(n_tok, width, threads))
        kernel = _build(int(top_k), np.dtype(norm_weight.dtype), per_thread(width, threads))[1]
        kernel[grid, threads, stream](y, position, weights, h, norm_weight, np.float32(eps), out, tickets)


def sm90_signatures():
    """(python function, numba signature) of every kernel variant, for the sm_90 compile check."""
    f2, i1 = types.float32[:, ::1], types.int32[::1]
    plain = [(_build(k)[0], (f2, i1, f2, f2)) for k in (2, 4, 8)]   # mixtral's, qwen2-moe's, qwen3's top-k
    normed = [(_build(k, np.dtype(np.uint16), per)[0], (f2, i1, f2, f2, types.uint16[::1], types.float32, f2, i1))
              for k, per in ((2, 16), (8, 8))]   # mixtral's and qwen3's hidden sizes over 256 threads, bf16 norms
    return plain + normed
