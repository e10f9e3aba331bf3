"""Per-head q/k RMSNorm (Qwen3-MoE), RoPE and the KV-cache write in one launch: what the decoder ran as
`rmsnorm` on q, `rmsnorm` on k, then `rope_kv_write` (numpy reference: expert_service.cpu.layers.norm.rms_norm
per head, then expert_service.cpu.layers.rope.Rotary.cos_sin + apply_rotary, then
expert_service.cpu.layers.attention.write_kv).

For token t, head h (q heads, then k heads) with x = its Hd values:
    n = (x / sqrt(mean(x^2) + eps)) * w          (w = q_norm or k_norm weight [Hd])
    q[t, h] <- rotate(n)                          (in place)
    k_pool[slot, h] <- narrow(rotate(n))          (slot = slot_mapping[t] >= 0; k itself is not written)
    v_pool[slot] <- narrow(v[t])                  (slot >= 0)
with rope's rotation of pairs (i, i + Hd/2) at positions[t] (`rope.rotation` / `rope.rotate`).

One warp per head: lane l holds elements l + 32m (m < Hd/32) in registers, so the pairs (i, i + Hd/2) are in one
lane (m and m + Hd/64) and the norm is a warp reduction, no shared memory or barrier. The sum of squares adds
the chunks in rmsnorm's order (one butterfly per 32-element chunk, chunk totals in order), the normalised values
are rmsnorm's expression and the rotation is rope's functions, so the result has the bits of the three kernels it
replaces. Warps past the q and k heads copy v, a head's Hd values each. Grid (T, ceil((H + 2 Hkv) / WARPS)).
Hd must be a multiple of 64 (pairs in one lane), at most 256.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import SIMULATOR, WARP, storer, warp_sum, widener
from expert_service.kernels.rope import rotate, rotation

WARPS = 2 if SIMULATOR else 4     # heads a block (qwen3: 32 + 2 * 4 = 40 heads -> 10 blocks a token)
MAX_HEAD_DIM = 256


@functools.cache
def _build(pool_dtype, weight_dtype, per_lane: int, mode: int = 0):
    """per_lane = Hd / 32 elements a lane (compile-time: the row stays in registers, the loops unroll); mode: the
    programmatic-launch variant (kernels/programmatic.py)."""
    store, widen = storer(pool_dtype), widener(weight_dtype)
    prologue = programmatic.prologue(mode)
    pairs = per_lane // 2

    def qk_norm_rope_kv_write_kernel(q, k, v, q_weight, k_weight, eps, positions, inv_freq, scale, slot_mapping,
                                     k_pool, v_pool):
        """q: [T, H, Hd] float32, normalised and rotated in place. k, v: [T, Hkv, Hd] float32 (read only).
        q_weight, k_weight: [Hd] W. eps: float32. positions: [T] int32. inv_freq: [Hd/2] float32. scale:
        float32 multiplier of cos and sin. slot_mapping: [T] int32 (< 0: padding, nothing written).
        k_pool, v_pool: [NB * BS * Hkv * Hd] flat views of the layer's pools. Grid (T, Y), block (WARPS * 32,)."""
        prologue()
        t = cuda.blockIdx.x
        lane = cuda.threadIdx.x % WARP
        head = cuda.blockIdx.y * (cuda.blockDim.x // WARP) + cuda.threadIdx.x // WARP
        num_q, num_kv = q.shape[1], k.shape[1]
        head_dim = q.shape[2]
        half = head_dim // 2
        slot = slot_mapping[t]
        base = np.int64(slot) * (num_kv * head_dim)      # int64: pools can exceed 2**31 elements
        if head >= num_q + num_kv:                        # the v heads: a copy to the pool
            h = head - num_q - num_kv
            if slot >= 0 and h < num_kv:
                for m in range(per_lane):
                    i = lane + m * WARP
                    store(v_pool, base + h * head_dim + i, v[t, h, i])
            return
        is_q = head < num_q
        h = head if is_q else head - num_q
        x = cuda.local.array(per_lane, np.float32)
        for m in range(per_lane):
            x[m] = q[t, h, lane + m * WARP] if is_q else k[t, h, lane + m * WARP]
        ss = np.float32(0.0)
        for m in range(per_lane):                         # rmsnorm's order: chunk totals added in order
            ss += warp_sum(x[m] * x[m])
        denom = math.sqrt(ss / np.float32(head_dim) + eps)
        for m in range(per_lane):
            i = lane + m * WARP
            x[m] = (x[m] / denom) * widen(q_weight[i] if is_q else k_weight[i])
        pos = np.float32(positions[t])
        for m in range(pairs):
            i = lane + m * WARP
            c, s = rotation(pos, inv_freq, i, scale)
            r1, r2 = rotate(x[m], x[m + pairs], c, s)
            if is_q:
                q[t, h, i] = r1
                q[t, h, i + half] = r2
            elif slot >= 0:
                at = base + h * head_dim + i
                store(k_pool, at, r1)
                store(k_pool, at + half, r2)

    return qk_norm_rope_kv_write_kernel, programmatic.compiled(qk_norm_rope_kv_write_kernel, mode)


def supports(head_dim: int) -> bool:
    """Head sizes the fused kernel takes: each pair (i, i + Hd/2) in one lane."""
    return head_dim % (2 * WARP) == 0 and head_dim <= MAX_HEAD_DIM


def launch_qk_norm_rope_kv_write(q, k, v, q_weight, k_weight, eps, positions, inv_freq, scale, slot_mapping,
                                 k_pool, v_pool, stream=0) -> None:
    """q: [T, H, Hd] float32 device array, normalised per head and rotated in place; k, v: [T, Hkv, Hd] float32
    (the step's new keys and values; not modified); q_weight, k_weight: [Hd] float32 / float16 / uint16
    (bfloat16 bits); eps: float; positions: [T] int32; inv_freq: [Hd/2] float32; scale: float (1.0 unless yarn);
    slot_mapping: [T] int32 (slot = block * BS + row, negative = skip); k_pool, v_pool: [NB, BS, Hkv, Hd] of one
    storage dtype: the normalised, rotated keys and the values written at each token's slot."""
    num_tokens, num_q, head_dim = q.shape
    assert supports(head_dim), f"head_dim {head_dim}: a multiple of {2 * WARP} up to {MAX_HEAD_DIM}"
    assert k.ndim == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert v.shape == k.shape and q.dtype == k.dtype == v.dtype == inv_freq.dtype == np.float32, (v.shape, v.dtype)
    assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.dtype == k_weight.dtype, \
        (q_weight.shape, k_weight.shape)
    assert q_weight.dtype in (np.float32, np.float16, np.uint16), q_weight.dtype
    assert inv_freq.shape == (head_dim // 2,), inv_freq.shape
    assert positions.shape == (num_tokens,) and positions.dtype == np.int32, (positions.shape, positions.dtype)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == np.int32, slot_mapping.dtype
    assert k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype, (k_pool.shape, v_pool.shape)
    assert k_pool.shape[2:] == k.shape[1:], (k_pool.shape, k.shape)
    for a in (q, k, v, q_weight, k_weight, positions, inv_freq, slot_mapping, k_pool, v_pool):
        assert a.flags["C_CONTIGUOUS"], "qk_norm_rope_kv_write needs contiguous arrays"
    if num_tokens == 0:
        return
    kernel = _build(np.dtype(k_pool.dtype), np.dtype(q_weight.dtype), head_dim // WARP, programmatic.mode())[1]
    grid = (num_tokens, -(-(num_q + 2 * k.shape[1]) // WARPS))
    kernel[grid, WARPS * WARP, stream](q, k, v, q_weight, k_weight, np.float32(eps), positions, inv_freq,
                                       np.float32(scale), slot_mapping, k_pool.reshape(-1), v_pool.reshape(-1))


def sm90_signatures():
    """(python function, numba signature) of each pool dtype (weights in the same dtype) and head size 64 / 128,
    128 also waiting, for the sm_90 compile check."""
    f3, i1 = types.float32[:, :, ::1], types.int32[::1]
    out = []
    for dtype, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        for per_lane, wait in ((2, False), (4, False), (4, True)):
            out.append((_build(np.dtype(dtype), np.dtype(dtype), per_lane, wait)[0],
                        (f3, f3, f3, nb[::1], nb[::1], types.float32, i1, types.float32[::1], types.float32, i1,
                         nb[::1], nb[::1])))
    return out
