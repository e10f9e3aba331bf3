"""Rotate-half (NeoX) rotary embedding, in place on q and k (numpy reference:
expert_service.cpu.layers.rope.Rotary.cos_sin + apply_rotary).

For token t, head h and i < Hd/2, with f = float32(positions[t]) * inv_freq[i] (float32, as the reference),
c = cos(f) * scale, s = sin(f) * scale (scale = yarn attention factor, 1.0 otherwise):
    x[i] <- x[i] * c - x[i + Hd/2] * s;   x[i + Hd/2] <- x[i + Hd/2] * c + x[i] * s
One block per token, threads striding over the (H + Hkv) * Hd/2 rotation pairs of q then k: consecutive
threads touch consecutive i (coalesced); each thread recomputes its cos/sin (cheaper than a cos/sin cache
read for a memory-bound op). No fastmath: accurate cosf/sinf match numpy at large positions.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit

THREADS = 128   # 4 warps; 40 heads * 64 pairs = 2560 pairs per token -> 20 per thread


@cuda.jit(device=True, inline=True)
def rotation(pos, inv_freq, i, scale):
    """(c, s) of rotation pair i at position pos (float32): cos and sin of pos * inv_freq[i], times scale."""
    f = pos * inv_freq[i]
    return math.cos(f) * scale, math.sin(f) * scale


@cuda.jit(device=True, inline=True)
def rotate(x1, x2, c, s):
    """The pair (x[i], x[i + Hd/2]) rotated by (c, s). rope_kv_write uses it too: the same bits in both kernels."""
    return x1 * c - x2 * s, x2 * c + x1 * s


def rope_kernel(q, k, positions, inv_freq, scale):
    """q: [T, H, Hd] float32, k: [T, Hkv, Hd] float32, rotated in place. positions: [T] int32.
    inv_freq: [Hd/2] float32. scale: float32 multiplier of cos and sin. Grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    half = inv_freq.shape[0]
    num_q = q.shape[1] * half
    total = num_q + k.shape[1] * half
    pos = np.float32(positions[t])
    for p in range(cuda.threadIdx.x, total, cuda.blockDim.x):
        i = p % half
        c, s = rotation(pos, inv_freq, i, scale)
        if p < num_q:
            h = p // half
            r1, r2 = rotate(q[t, h, i], q[t, h, i + half], c, s)
            q[t, h, i] = r1
            q[t, h, i + half] = r2
        else:
            h = (p - num_q) // half
            r1, r2 = rotate(k[t, h, i], k[t, h, i + half], c, s)
            k[t, h, i] = r1
            k[t, h, i + half] = r2


_rope = cached_jit(rope_kernel)


def launch_rope(q, k, positions, inv_freq, scale, stream=0, threads=THREADS) -> None:
    """q: [T, H, Hd] float32 and k: [T, Hkv, Hd] float32 device arrays, rotated in place; positions: [T] int32;
    inv_freq: [Hd/2] float32 (RopeConfig.inverse_frequencies); scale: float (1.0 unless yarn)."""
    num_tokens, _, head_dim = q.shape
    assert k.ndim == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert q.dtype == k.dtype == inv_freq.dtype == np.float32, (q.dtype, k.dtype, inv_freq.dtype)
    assert head_dim % 2 == 0 and inv_freq.shape == (head_dim // 2,), (head_dim, inv_freq.shape)
    assert positions.shape == (num_tokens,) and positions.dtype == np.int32, (positions.shape, positions.dtype)
    assert threads % 32 == 0 and 0 < threads <= 1024, threads
    for a in (q, k, positions, inv_freq):
        assert a.flags["C_CONTIGUOUS"], "rope needs contiguous arrays"
    if num_tokens == 0:
        return
    _rope[num_tokens, threads, stream](q, k, positions, inv_freq, np.float32(scale))


def sm90_signatures():
    """(python function, numba signature) for the sm_90 compile check."""
    f3 = types.float32[:, :, ::1]
    return [(rope_kernel, (f3, f3, types.int32[::1], types.float32[::1], types.float32))]
