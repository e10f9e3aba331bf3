"""Write a step's new keys and values into one layer's paged KV pool (numpy reference:
expert_service.cpu.layers.attention.write_kv).

One block per token, threads striding over its Hkv*Hd values: a token's row of the pool
([BS, Hkv, Hd] is row-major, so (slot, kv head, dim) is contiguous per slot) is one contiguous run, so
reads of k/v and writes to the pool are both coalesced.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import storer

THREADS = 128   # 4 warps; a token's row is Hkv*Hd values (1024 for Hkv=8, Hd=128): 8 per thread


@functools.cache
def _build(pool_dtype):
    store = storer(pool_dtype)

    def kv_write_kernel(k, v, slot_mapping, k_pool, v_pool):
        """k, v: [T, Hkv*Hd] float32, the step's new keys/values (row t = token t).
        slot_mapping: [T] int32, flat pool slot (block * BS + row) of each token; < 0 = padding, skipped.
        k_pool, v_pool: [NB * BS * Hkv * Hd] flat views of the layer's pools [NB, BS, Hkv, Hd] in the pool
        dtype (float32, float16 or uint16 = bfloat16 bits). Grid (T,), block (THREADS,)."""
        t = cuda.blockIdx.x
        slot = slot_mapping[t]
        if slot < 0:
            return
        row = k.shape[1]
        base = np.int64(slot) * row      # int64: pools can exceed 2**31 elements
        for e in range(cuda.threadIdx.x, row, cuda.blockDim.x):
            store(k_pool, base + e, k[t, e])
            store(v_pool, base + e, v[t, e])

    return kv_write_kernel, cached_jit(kv_write_kernel)


def launch_kv_write(k, v, slot_mapping, k_pool, v_pool, stream=0) -> None:
    """k, v: [T, Hkv, Hd] float32 device arrays; slot_mapping: [T] int32 (slot = block * BS + row, negative
    = skip); k_pool, v_pool: [NB, BS, Hkv, Hd] device arrays of one storage dtype (float32, float16, or
    uint16 holding bfloat16 bits), written in place with round-to-nearest-even narrowing."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k.dtype == v.dtype == np.float32, (k.shape, v.shape, k.dtype, v.dtype)
    assert k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype, (k_pool.shape, v_pool.shape)
    assert k_pool.shape[2:] == (num_kv_heads, head_dim), (k_pool.shape, k.shape)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == np.int32, slot_mapping.dtype
    for a in (k, v, slot_mapping, k_pool, v_pool):
        assert a.flags["C_CONTIGUOUS"], "kv_write needs contiguous arrays"
    if num_tokens == 0:
        return
    kernel = _build(np.dtype(k_pool.dtype))[1]
    row = num_kv_heads * head_dim
    kernel[num_tokens, THREADS, stream](k.reshape(num_tokens, row), v.reshape(num_tokens, row), slot_mapping,
                                        k_pool.reshape(-1), v_pool.reshape(-1))


def sm90_signatures():
    """(python function, numba signature) of each pool-dtype variant, for the sm_90 compile check."""
    out = []
    for dtype, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        f32_2d = types.float32[:, ::1]
        out.append((_build(np.dtype(dtype))[0], (f32_2d, f32_2d, types.int32[::1], nb[::1], nb[::1])))
    return out
