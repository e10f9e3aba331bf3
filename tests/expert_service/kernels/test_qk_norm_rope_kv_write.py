"""qk_norm_rope_kv_write vs numpy (per-head rms_norm, apply_rotary, write_kv) and bit for bit vs the kernels it
replaces (rmsnorm on q and k, then rope_kv_write), on ragged steps over shuffled paged KV blocks with padding
tokens, in the simulator and (gpu) on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.norm import rms_norm
from expert_service.kernels.qk_norm_rope_kv_write import launch_qk_norm_rope_kv_write, supports
from expert_service.kernels.rmsnorm import launch_rmsnorm
from expert_service.kernels.rope_kv_write import launch_rope_kv_write
from tests.expert_service.kernels.test_rope_kv_write import _rotate, assert_pool_writes, ragged_step
from tests.helpers import STORAGE_DTYPES, assert_close, random_weight, to_storage

EPS = 1e-6


def _check(rng, cached, new, pad, heads, kv_heads, head_dim, block_size, dtype, scale):
    positions, slots, num_blocks = ragged_step(rng, cached, new, block_size, pad)
    T = len(positions)
    q = rng.standard_normal((T, heads, head_dim), dtype=np.float32) * np.float32(3.0)
    k = rng.standard_normal((T, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((T, kv_heads, head_dim), dtype=np.float32)
    q_w, q_wf = random_weight(rng, (head_dim,), dtype)
    k_w, k_wf = random_weight(rng, (head_dim,), dtype)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    pool_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_pool = to_storage(rng.standard_normal(pool_shape, dtype=np.float32), dtype)
    v_pool = to_storage(rng.standard_normal(pool_shape, dtype=np.float32), dtype)
    d_q, d_k, d_v = cuda.to_device(q), cuda.to_device(k), cuda.to_device(v)
    d_qw, d_kw = cuda.to_device(q_w), cuda.to_device(k_w)
    d_pos, d_slots, d_freq = cuda.to_device(positions), cuda.to_device(slots), cuda.to_device(inv_freq)
    d_kp, d_vp = cuda.to_device(k_pool), cuda.to_device(v_pool)
    launch_qk_norm_rope_kv_write(d_q, d_k, d_v, d_qw, d_kw, EPS, d_pos, d_freq, scale, d_slots, d_kp, d_vp)
    got_q, got_kp, got_vp = d_q.copy_to_host(), d_kp.copy_to_host(), d_vp.copy_to_host()

    assert_close(got_q, _rotate(rms_norm(q, q_wf, EPS), positions, inv_freq, scale), 1e-5)  # padding rows too
    np.testing.assert_array_equal(d_k.copy_to_host(), k)  # k itself is left as it was
    assert_pool_writes(
        got_kp, got_vp, k_pool, v_pool, _rotate(rms_norm(k, k_wf, EPS), positions, inv_freq, scale), v, slots, dtype
    )

    # the kernels it replaces, on the same inputs: the same bits
    u_q, u_k, u_kp, u_vp = cuda.to_device(q), cuda.to_device(k), cuda.to_device(k_pool), cuda.to_device(v_pool)
    launch_rmsnorm(u_q, d_qw, EPS, u_q)
    launch_rmsnorm(u_k, d_kw, EPS, u_k)
    launch_rope_kv_write(u_q, u_k, d_v, d_pos, d_freq, scale, d_slots, u_kp, u_vp)
    np.testing.assert_array_equal(got_q, u_q.copy_to_host())
    np.testing.assert_array_equal(got_kp, u_kp.copy_to_host())
    np.testing.assert_array_equal(got_vp, u_vp.copy_to_host())


def test_supported_head_sizes():
    assert [d for d in (32, 48, 64, 96, 128, 192, 256, 320) if supports(d)] == [64, 128, 192, 256]


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize(
    "cached,new,pad,heads,kv_heads,head_dim,scale",
    [
        ([0], [1], 0, 2, 1, 64, 1.0),  # one token; 4 heads over 2 blocks (v heads included)
        ([3, 0, 9], [1, 3, 2], 2, 3, 1, 64, 1.3),  # ragged: a decode, a first chunk, a later chunk; padding
        ([6, 1], [1, 1], 1, 2, 1, 128, 1.0),  # a decode batch with a padded bucket slot, Hd 128
    ],
)
def test_qk_norm_rope_kv_write_matches_reference(dtype, cached, new, pad, heads, kv_heads, head_dim, scale):
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
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("shape", ["decode64", "prefill"])
def test_qk_norm_rope_kv_write_gpu(dtype, shape):
    rng = np.random.default_rng(19)
    if shape == "decode64":  # 64 decodes at ragged contexts, 3 padding slots of a graph bucket
        cached, new, pad = list(rng.integers(1, 1000, 61)), [1] * 61, 3
    else:  # chunked prefill of ragged sequences
        cached, new, pad = [0, 100, 7, 0], [512, 300, 1, 33], 0
    _check(rng, cached, new, pad, 32, 4, 128, 16, dtype, 1.0)
    _check(rng, cached[:4], new[:4], 0, 16, 2, 64, 16, dtype, 1.2)
