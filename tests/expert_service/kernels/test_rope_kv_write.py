"""rope_kv_write vs numpy (apply_rotary, then write_kv) and bit for bit vs the unfused rope + kv_write, on a
step of ragged sequences over shuffled paged KV blocks with padding tokens, in the simulator and (gpu) on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.attention import write_kv
from expert_service.cpu.layers.rope import apply_rotary
from expert_service.kernels.kv_write import launch_kv_write
from expert_service.kernels.numeric import blocks_per_row
from expert_service.kernels.rope import launch_rope
from expert_service.kernels.rope_kv_write import launch_rope_kv_write
from tests.helpers import STORAGE_DTYPES, assert_close, from_storage, random_cache, to_storage


def _rotate(x, positions, inv_freq, scale):
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos = (np.cos(emb) * np.float32(scale)).astype(np.float32)
    sin = (np.sin(emb) * np.float32(scale)).astype(np.float32)
    return apply_rotary(x, cos, sin)


def ragged_step(rng, cached, new, block_size, pad):
    """A step where sequence s already holds cached[s] tokens and adds new[s] (prefill chunks and decodes mixed),
    then `pad` padding tokens: (positions [T] int32, slot_mapping [T] int32, context lengths, block tables)."""
    context = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-c // block_size) for c in context) + 3
    positions, slots = [], []
    _, _, tables, _ = random_cache(rng, context, num_blocks, block_size, 1, 2, np.float32)
    for s, (c, n) in enumerate(zip(cached, new)):
        for p in range(c, c + n):
            positions.append(p)
            slots.append(tables[s, p // block_size] * block_size + p % block_size)
    positions += [0] * pad
    slots += [-1] * pad
    return np.array(positions, np.int32), np.array(slots, np.int32), num_blocks


def assert_pool_writes(got_kp, got_vp, k_pool, v_pool, keys, v, slots, dtype):
    """The pools after a kernel wrote each real token's (slot >= 0) expected keys [T, Hkv, Hd] (float32, before
    narrowing) and values v at its slot: other slots untouched, values an exact narrowing copy, keys within one
    16-bit ulp where cos/sin differ."""
    real = slots >= 0
    want_k, want_v = k_pool.copy(), v_pool.copy()
    write_kv(want_k, want_v, to_storage(keys[real], dtype), to_storage(v[real], dtype), slots[real])
    written = np.zeros(k_pool.shape[0] * k_pool.shape[1], bool)
    written[slots[real]] = True
    written = written.reshape(k_pool.shape[:2])
    np.testing.assert_array_equal(got_kp[~written], k_pool[~written])  # other slots untouched
    np.testing.assert_array_equal(got_vp, want_v)  # values: an exact narrowing copy
    tol = 1e-2 if np.dtype(dtype) != np.float32 else 1e-5  # one 16-bit ulp where cos/sin differ
    assert_close(from_storage(got_kp[written]), from_storage(want_k[written]), tol)


def _check(rng, cached, new, pad, heads, kv_heads, head_dim, block_size, dtype, scale, threads):
    positions, slots, num_blocks = ragged_step(rng, cached, new, block_size, pad)
    T = len(positions)
    q = rng.standard_normal((T, heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((T, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((T, kv_heads, head_dim), dtype=np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    pool_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_pool = to_storage(rng.standard_normal(pool_shape, dtype=np.float32), dtype)
    v_pool = to_storage(rng.standard_normal(pool_shape, dtype=np.float32), dtype)
    d_q, d_k, d_v = cuda.to_device(q), cuda.to_device(k), cuda.to_device(v)
    d_pos, d_slots, d_freq = cuda.to_device(positions), cuda.to_device(slots), cuda.to_device(inv_freq)
    d_kp, d_vp = cuda.to_device(k_pool), cuda.to_device(v_pool)
    launch_rope_kv_write(d_q, d_k, d_v, d_pos, d_freq, scale, d_slots, d_kp, d_vp, threads=threads)
    got_q, got_kp, got_vp = d_q.copy_to_host(), d_kp.copy_to_host(), d_vp.copy_to_host()

    assert_close(got_q, _rotate(q, positions, inv_freq, scale), 1e-5)  # every q row, padding included
    np.testing.assert_array_equal(d_k.copy_to_host(), k)  # k itself is left as it was
    assert_pool_writes(got_kp, got_vp, k_pool, v_pool, _rotate(k, positions, inv_freq, scale), v, slots, dtype)

    # the unfused kernels on the same inputs give the same bits (rope's arithmetic, kv_write's narrowing)
    u_q, u_k, u_kp, u_vp = cuda.to_device(q), cuda.to_device(k), cuda.to_device(k_pool), cuda.to_device(v_pool)
    launch_rope(u_q, u_k, d_pos, d_freq, scale, threads=threads)
    launch_kv_write(u_k, d_v, d_slots, u_kp, u_vp)
    np.testing.assert_array_equal(got_q, u_q.copy_to_host())
    np.testing.assert_array_equal(got_kp, u_kp.copy_to_host())
    np.testing.assert_array_equal(got_vp, u_vp.copy_to_host())


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize(
    "cached,new,pad,heads,kv_heads,head_dim,scale",
    [
        ([0], [1], 0, 2, 1, 8, 1.0),  # one token of one sequence
        ([3, 0, 9], [1, 5, 2], 2, 3, 1, 12, 1.3),  # ragged: a decode, a first chunk, a later chunk; padding
        ([6, 1], [1, 1], 1, 4, 2, 8, 1.0),  # a decode batch with a padded bucket slot
        ([5], [1], 0, 8, 2, 16, 1.0),  # one decode token spread over 3 blocks (80 pairs)
        ([2, 9], [3, 1], 1, 8, 4, 16, 0.9),  # 5 tokens, 3 blocks each
    ],
)
def test_rope_kv_write_matches_reference(dtype, cached, new, pad, heads, kv_heads, head_dim, scale):
    assert blocks_per_row(sum(new) + pad, (heads + kv_heads) * head_dim // 2, 32) == (3 if head_dim == 16 else 1)
    _check(
        np.random.default_rng(sum(new) + head_dim),
        cached,
        new,
        pad,
        heads,
        kv_heads,
        head_dim,
        block_size=4,
        dtype=dtype,
        scale=scale,
        threads=32,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("shape", ["decode64", "prefill"])
def test_rope_kv_write_gpu(dtype, shape):
    rng = np.random.default_rng(17)
    if shape == "decode64":  # 64 decodes at ragged contexts, 3 padding slots of a graph bucket
        cached, new, pad = list(rng.integers(1, 1000, 61)), [1] * 61, 3
    else:  # chunked prefill of ragged sequences
        cached, new, pad = [0, 100, 7, 0], [512, 300, 1, 33], 0
    _check(rng, cached, new, pad, 32, 8, 128, 16, dtype, 1.0, threads=128)
    _check(rng, cached[:4], new[:4], 0, 32, 4, 64, 16, dtype, 1.2, threads=128)
