"""kv_write kernel vs expert_service.cpu.layers.attention.write_kv, in the simulator and (gpu) on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.attention import write_kv
from expert_service.kernels.kv_write import launch_kv_write
from tests.helpers import STORAGE_DTYPES, to_storage


def _check(rng, num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype, pad=0):
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False).astype(np.int32)
    if pad:
        slots[-pad:] = -1
    k_pool = to_storage(rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32), dtype)
    v_pool = to_storage(rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim), dtype=np.float32), dtype)
    real = slots >= 0
    want_k, want_v = k_pool.copy(), v_pool.copy()
    write_kv(want_k, want_v, to_storage(k[real], dtype), to_storage(v[real], dtype), slots[real])
    d_k, d_v = cuda.to_device(k_pool), cuda.to_device(v_pool)
    launch_kv_write(cuda.to_device(k), cuda.to_device(v), cuda.to_device(slots), d_k, d_v)
    np.testing.assert_array_equal(d_k.copy_to_host(), want_k)
    np.testing.assert_array_equal(d_v.copy_to_host(), want_v)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim,pad", [(1, 1, 20, 0), (5, 2, 24, 2)])
def test_kv_write_matches_reference(dtype, num_tokens, num_kv_heads, head_dim, pad):
    _check(
        np.random.default_rng(num_tokens),
        num_tokens,
        num_blocks=4,
        block_size=4,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        pad=pad,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 33, 4096])
def test_kv_write_gpu(dtype, num_tokens):
    _check(
        np.random.default_rng(7),
        num_tokens,
        num_blocks=512,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        pad=1 if num_tokens > 1 else 0,
    )
