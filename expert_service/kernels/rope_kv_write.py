"""RoPE on the step's queries and keys fused with the KV-cache write: one launch where the decoder ran `rope`
then `kv_write` (numpy reference: expert_service.cpu.layers.rope.Rotary.cos_sin + apply_rotary, then
expert_service.cpu.layers.attention.write_kv).

For token t with slot = slot_mapping[t] (flat pool slot: block * BS + row; < 0 = padding), head h and i < Hd/2,
with f = float32(positions[t]) * inv_freq[i], c = cos(f) * scale, s = sin(f) * scale:
    q[t, h, i] <- q[t, h, i] * c - q[t, h, i + Hd/2] * s;   q[t, h, i + Hd/2] <- q[.., i + Hd/2] * c + q[.., i] * s
    k_pool[slot, h, i] <- narrow(k[t, h, i] * c - k[t, h, i + Hd/2] * s), likewise i + Hd/2   (slot >= 0)
    v_pool[slot] <- narrow(v[t])                                                                (slot >= 0)
The rotated keys go to the pool only: k itself is left as it was (attention reads keys from the pool), which
saves the write and re-read of k between the two old kernels. The arithmetic is rope's (its `rotation` and
`rotate`), and the narrowing kv_write's, so the pool holds the same bits as `rope` + `kv_write`.

Grid (T, Y): the Y blocks of a token stride together over its (H + Hkv) * Hd/2 rotation pairs of q then k
(consecutive threads touch consecutive i: coalesced), then over its Hkv * Hd values of v (one contiguous run of
the pool). Y = 1 for large steps (one block per token, as the two kernels it replaces); small steps spread a token
over up to one pair per thread (`numeric.blocks_per_row`): with one block a decode token's 2304 qwen3 pairs took 18
serial rounds of loads and sincos (13.5 µs a layer on the H200). Each element's arithmetic does not depend on Y.
Padding tokens still rotate q (harmless, attention ignores them) and write nothing.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.numeric import blocks_per_row, storer
from expert_service.kernels.rope import rotate, rotation

THREADS = 128   # as rope and kv_write: 4 warps; qwen3 (H 32, Hkv 4, Hd 128): 2304 pairs + 512 values per token


@functools.cache
def _build(pool_dtype, half: int, mode: int = 0):
    """half = Hd / 2 is a compile-time constant: the pair index's division and remainder by it become shifts
    (by a runtime value they were 64-bit division calls, most of the kernel's time). mode: the
    programmatic-launch variant (kernels/programmatic.py)."""
    store = storer(pool_dtype)
    prologue = programmatic.prologue(mode)

    def rope_kv_write_kernel(q, k, v, positions, inv_freq, scale, slot_mapping, k_pool, v_pool):
        """q: [T, H, Hd] float32, rotated in place. k: [T, Hkv, Hd] float32 (read only). v: [T, Hkv * Hd] float32.
        positions: [T] int32. inv_freq: [Hd/2] float32. scale: float32 multiplier of cos and sin.
        slot_mapping: [T] int32 (< 0: padding, nothing written). k_pool, v_pool: [NB * BS * Hkv * Hd] flat
        views of the layer's pools in the pool dtype. Grid (T, Y), block (THREADS,)."""
        prologue()
        t = cuda.blockIdx.x
        first = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        stride = cuda.gridDim.y * cuda.blockDim.x
        head_dim = 2 * half
        num_q = q.shape[1] * half
        total = num_q + k.shape[1] * half
        pos = np.float32(positions[t])
        slot = slot_mapping[t]
        row = v.shape[1]
        base = np.int64(slot) * row      # int64: pools can exceed 2**31 elements
        for p in range(first, total, stride):
            i = p % half
            c, s = rotation(pos, inv_freq, i, scale)
            if p < num_q:
                h = p // half
                r1, r2 = rotate(q[t, h, i], q[t, h, i + half], c, s)
                q[t, h, i] = r1
                q[t, h, i + half] = r2
            elif slot >= 0:
                h = (p - num_q) // half
                r1, r2 = rotate(k[t, h, i], k[t, h, i + half], c, s)
                at = base + h * head_dim + i
                store(k_pool, at, r1)
                store(k_pool, at + half, r2)
        if slot >= 0:
            for e in range(first, row, stride):
                store(v_pool, base + e, v[t, e])

    return rope_kv_write_kernel, programmatic.compiled(rope_kv_write_kernel, mode)


def launch_rope_kv_write(q, k, v, positions, inv_freq, scale, slot_mapping, k_pool, v_pool, stream=0,
                         threads=THREADS) -> None:
    """q: [T, H, Hd] float32 device array, rotated in place; k, v: [T, Hkv, Hd] float32 (the step's new keys and
    values; k is not modified); positions: [T] int32; inv_freq: [Hd/2] float32 (RopeConfig.inverse_frequencies);
    scale: float (1.0 unless yarn); slot_mapping: [T] int32 (slot = block * BS + row, negative = skip);
    k_pool, v_pool: [NB, BS, Hkv, Hd] device arrays of one storage dtype (float32, float16, or uint16 holding
    bfloat16 bits): the rotated keys and the values written at each token's slot, rounded to nearest even."""
    num_tokens, _, head_dim = q.shape
    assert k.ndim == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert v.shape == k.shape and q.dtype == k.dtype == v.dtype == inv_freq.dtype == np.float32, (v.shape, v.dtype)
    assert head_dim % 2 == 0 and inv_freq.shape == (head_dim // 2,), (head_dim, inv_freq.shape)
    assert positions.shape == (num_tokens,) and positions.dtype == np.int32, (positions.shape, positions.dtype)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == np.int32, slot_mapping.dtype
    assert k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype, (k_pool.shape, v_pool.shape)
    assert k_pool.shape[2:] == k.shape[1:], (k_pool.shape, k.shape)
    assert threads % 32 == 0 and 0 < threads <= 1024, threads
    for a in (q, k, v, positions, inv_freq, slot_mapping, k_pool, v_pool):
        assert a.flags["C_CONTIGUOUS"], "rope_kv_write needs contiguous arrays"
    if num_tokens == 0:
        return
    row = k.shape[1] * head_dim
    kernel = _build(np.dtype(k_pool.dtype), head_dim // 2, programmatic.mode())[1]
    grid = (num_tokens, blocks_per_row(num_tokens, (q.shape[1] + k.shape[1]) * head_dim // 2, threads))
    kernel[grid, threads, stream](q, k, v.reshape(num_tokens, row), positions, inv_freq, np.float32(scale),
                                  slot_mapping, k_pool.reshape(-1), v_pool.reshape(-1))


def sm90_signatures():
    """(python function, numba signature) of each pool-dtype variant, for the sm_90 compile check."""
    f3, f2, i1 = types.float32[:, :, ::1], types.float32[:, ::1], types.int32[::1]
    out = []
    for dtype, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        for half, wait in ((32, False), (64, False), (64, True)):       # head sizes 64 and 128
            out.append((_build(np.dtype(dtype), half, wait)[0], (f3, f3, f2, i1, types.float32[::1], types.float32, i1,
                                                           nb[::1], nb[::1])))
    return out
