"""attention_decode_tiled vs expert_service.cpu.layers.attention.paged_attention (one query per sequence), and the
fastest-kernel choice. Contexts span several 32-key tiles (cp.async double buffering) and partial last tiles."""

from __future__ import annotations

import numpy as np
import pytest

from expert_service.kernels.attention_decode_tiled import (
    launch_attention_decode_fastest,
    launch_attention_decode_tiled,
    supports,
)
from tests.helpers import check_decode_attention


def _check(rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, splits, launch, rtol=1e-5, **kw):
    check_decode_attention(
        launch, rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, np.uint16, splits, rtol, **kw
    )


def test_gqa_group_of_8_over_several_tiles():
    # 8 query heads on one kv head (two score rounds per warp), contexts of 2 tiles (one partial) and 1 key
    _check(np.random.default_rng(1), [45, 1], 8, 1, 64, 16, 0, 1, launch_attention_decode_tiled)


def test_split_parts_with_an_idle_slot():
    # a group of 3 query heads (padded head rows), 2 parts of 23 and 22 keys, an idle slot (context 0: zeros)
    _check(np.random.default_rng(2), [45, 0], 3, 1, 64, 4, 0, 2, launch_attention_decode_tiled, min_keys=1)


def test_parts_follow_each_context():
    # at most 4 parts of at least 32 keys: 100 keys in 4 (32, 32, 32, 4), 40 in 2, 20 in one (its block writes the
    # output, the reduce skips it), an idle slot; then a window of 33 over 90 keys (two parts)
    rng = np.random.default_rng(6)
    _check(rng, [100, 40, 20, 0], 4, 1, 64, 8, 0, 4, launch_attention_decode_tiled, min_keys=32)
    _check(rng, [90], 2, 1, 64, 8, 33, 4, launch_attention_decode_tiled, min_keys=32)


def test_sliding_window_and_mha():
    # MHA (group 1: one head per block), window 20 inside a 50-key context split in 2, block size 8
    _check(np.random.default_rng(3), [50], 1, 1, 64, 8, 20, 2, launch_attention_decode_tiled, min_keys=1)


def test_head_dim_128_group_4():
    _check(np.random.default_rng(4), [40], 4, 1, 128, 16, 0, 1, launch_attention_decode_tiled)


def test_fastest_falls_back_where_the_tiled_kernel_does_not_apply():
    assert supports(np.uint16, 128, 16) and supports(np.uint16, 64, 4)
    assert not supports(np.float32, 128, 16) and not supports(np.uint16, 96, 16) and not supports(np.uint16, 128, 12)
    # block size 12 is not a power of two: attention_decode runs, same result
    _check(np.random.default_rng(5), [30], 2, 1, 64, 12, 0, 2, launch_attention_decode_fastest)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_seqs,num_kv_heads,max_ctx,window,splits",
    [(1, 8, 4096, 0, 16), (16, 4, 2048, 0, 5), (64, 4, 1024, 0, 2), (8, 8, 3000, 1024, 1)],
)
def test_decode_tiled_gpu(num_seqs, num_kv_heads, max_ctx, window, splits):
    rng = np.random.default_rng(num_seqs)
    lens = [int(x) for x in rng.integers(1, max_ctx + 1, num_seqs)]
    lens[0] = max_ctx
    _check(rng, lens, 32, num_kv_heads, 128, 16, window, splits, launch_attention_decode_tiled, rtol=1e-4)
