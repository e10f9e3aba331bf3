"""attention_decode_tiled vs expert_service.cpu.layers.attention.paged_attention (one query per sequence), and the
fastest-kernel choice. Contexts span several 32-key tiles (cp.async double buffering) and partial last tiles."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.attention import paged_attention
from expert_service.kernels.attention_decode_tiled import (launch_attention_decode_fastest,
                                                           launch_attention_decode_tiled, supports)

from tests.helpers import assert_close, from_storage, random_cache


def _check(rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, splits, launch,
           rtol=1e-5):
    num_seqs = len(context_lens)
    need = sum(-(-c // block_size) for c in context_lens)
    k_pool, v_pool, tables, lists = random_cache(rng, context_lens, need + 3, block_size, num_kv_heads, head_dim,
                                                 np.uint16)
    q = rng.standard_normal((num_seqs, num_heads, head_dim), dtype=np.float32)
    ctx = np.asarray(context_lens, dtype=np.int32)
    positions = ctx - 1
    scale = head_dim ** -0.5
    live = ctx > 0
    want = np.zeros_like(q)
    want[live] = paged_attention(q[live], from_storage(k_pool), from_storage(v_pool), np.arange(live.sum() + 1),
                                 ctx[live], [t for t, ok in zip(lists, live) if ok], positions[live], scale, window)
    out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float32))
    parts = [None, None]
    if splits > 1:
        parts = [cuda.to_device(np.full((num_seqs, num_heads, splits, n), np.nan, np.float32)) for n in (head_dim, 2)]
    launch(cuda.to_device(q), cuda.to_device(k_pool), cuda.to_device(v_pool), cuda.to_device(tables),
           cuda.to_device(ctx), cuda.to_device(positions), window, scale, out, *parts)
    assert_close(out.copy_to_host(), want, rtol)


def test_gqa_group_of_8_over_several_tiles():
    # 8 query heads on one kv head (two score rounds per warp), contexts of 2 tiles (one partial) and 1 key
    _check(np.random.default_rng(1), [45, 1], 8, 1, 64, 16, 0, 1, launch_attention_decode_tiled)


def test_split_parts_with_an_idle_slot():
    # a group of 3 query heads (padded head rows), 2 parts of 23 and 22 keys, an idle slot (context 0: zeros)
    _check(np.random.default_rng(2), [45, 0], 3, 1, 64, 4, 0, 2, launch_attention_decode_tiled)


def test_sliding_window_and_mha():
    # MHA (group 1: one head per block), window 20 inside a 50-key context split in 2, block size 8
    _check(np.random.default_rng(3), [50], 1, 1, 64, 8, 20, 2, launch_attention_decode_tiled)


def test_head_dim_128_group_4():
    _check(np.random.default_rng(4), [40], 4, 1, 128, 16, 0, 1, launch_attention_decode_tiled)


def test_fastest_falls_back_where_the_tiled_kernel_does_not_apply():
    assert supports(np.uint16, 128, 16) and supports(np.uint16, 64, 4)
    assert not supports(np.float32, 128, 16) and not supports(np.uint16, 96, 16) and not supports(np.uint16, 128, 12)
    # block size 12 is not a power of two: attention_decode runs, same result
    _check(np.random.default_rng(5), [30], 2, 1, 64, 12, 0, 2, launch_attention_decode_fastest)


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs,num_kv_heads,max_ctx,window,splits", [(1, 8, 4096, 0, 16), (16, 4, 2048, 0, 5),
                                                                          (64, 4, 1024, 0, 2), (8, 8, 3000, 1024, 1)])
def test_decode_tiled_gpu(num_seqs, num_kv_heads, max_ctx, window, splits):
    rng = np.random.default_rng(num_seqs)
    lens = [int(x) for x in rng.integers(1, max_ctx + 1, num_seqs)]
    lens[0] = max_ctx
    _check(rng, lens, 32, num_kv_heads, 128, 16, window, splits, launch_attention_decode_tiled, rtol=1e-4)
