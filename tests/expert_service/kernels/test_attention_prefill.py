"""attention_prefill kernel vs expert_service.cpu.layers.attention.paged_attention (varlen, chunked, windowed)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.attention import paged_attention
from expert_service.kernels.attention_prefill import launch_attention_prefill
from tests.helpers import STORAGE_DTYPES, assert_close, from_storage, random_cache


def _check(rng, new_tokens, history, num_heads, num_kv_heads, head_dim, block_size, window, dtype, rtol=1e-5):
    """Sequence s has history[s] cached tokens and new_tokens[s] new ones (0 allowed) in this step."""
    ctx = np.asarray(history, dtype=np.int32) + np.asarray(new_tokens, dtype=np.int32)
    need = sum(-(-int(c) // block_size) for c in ctx)
    k_pool, v_pool, tables, lists = random_cache(rng, ctx, need + 3, block_size, num_kv_heads, head_dim, dtype)
    seq_starts = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    positions = np.concatenate([np.arange(h, h + n) for h, n in zip(history, new_tokens)]).astype(np.int32)
    num_tokens = int(seq_starts[-1])
    q = rng.standard_normal((num_tokens, num_heads, head_dim), dtype=np.float32)
    scale = head_dim**-0.5
    want = paged_attention(
        q, from_storage(k_pool), from_storage(v_pool), seq_starts, ctx, lists, positions, scale, window
    )
    out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float32))
    launch_attention_prefill(
        cuda.to_device(q),
        cuda.to_device(k_pool),
        cuda.to_device(v_pool),
        cuda.to_device(seq_starts),
        cuda.to_device(positions),
        cuda.to_device(tables),
        cuda.to_device(ctx),
        window,
        scale,
        out,
    )
    assert_close(out.copy_to_host(), want, rtol)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_mixed_lengths_with_history(dtype):
    # 1-token sequence, a sequence with no new tokens, chunked prefill over cached history; Hd=20; GQA 2:1.
    _check(
        np.random.default_rng(1),
        new_tokens=[1, 5, 0, 3],
        history=[0, 2, 3, 4],
        num_heads=2,
        num_kv_heads=1,
        head_dim=20,
        block_size=4,
        window=0,
        dtype=dtype,
    )


def test_gqa_sliding_window_chunk():
    # window 3 < context; 4 query heads over 2 kv heads; Hd=24; second chunk of a prefill.
    _check(
        np.random.default_rng(2),
        new_tokens=[6, 2],
        history=[5, 0],
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        block_size=2,
        window=3,
        dtype=np.uint16,
    )


def test_several_query_and_key_tiles():
    # 40 new tokens after 5 cached: two query tiles of 32 and two key tiles; MQA (H=2, Hkv=1); window > tile.
    _check(
        np.random.default_rng(3),
        new_tokens=[40],
        history=[5],
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        block_size=4,
        window=37,
        dtype=np.float32,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize(
    "new_tokens,history,num_kv_heads,window",
    [
        ([512], [0], 8, 0),
        ([128] * 16, [0] * 16, 4, 0),
        ([1, 33, 700, 5], [0, 100, 3000, 1], 8, 0),
        ([256, 256], [512, 0], 8, 300),
    ],
)
def test_prefill_gpu(dtype, new_tokens, history, num_kv_heads, window):
    _check(
        np.random.default_rng(len(new_tokens)), new_tokens, history, 32, num_kv_heads, 128, 16, window, dtype, rtol=1e-4
    )


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 24, 256])
def test_prefill_gpu_head_dims(head_dim):
    _check(np.random.default_rng(head_dim), [100, 37], [0, 60], 8, 2, head_dim, 16, 0, np.uint16, rtol=1e-4)
