"""attention_decode kernel vs expert_service.cpu.layers.attention.paged_attention (one query per sequence)."""

from __future__ import annotations

import numpy as np
import pytest

from expert_service.kernels.attention_decode import decode_splits, launch_attention_decode
from tests.helpers import STORAGE_DTYPES, check_decode_attention


def _check(rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, dtype, splits, rtol=1e-5):
    check_decode_attention(
        launch_attention_decode,
        rng,
        context_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        window,
        dtype,
        splits,
        rtol,
    )


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_gqa_mixed_lengths_split(dtype):
    # 2 query heads on 1 kv head, Hd=20 (not a multiple of 32), contexts 1..9, 3 parts (some empty for ctx=1).
    _check(np.random.default_rng(1), [1, 9, 6], 2, 1, 20, 4, 0, dtype, splits=3)


def test_mqa_sliding_window_no_split():
    # 3 query heads on one kv head, window 3 < context, non-contiguous blocks.
    _check(np.random.default_rng(2), [7, 2], 3, 1, 24, 2, 3, np.uint16, splits=1)


def test_gqa_window_with_split():
    # 4 query heads over 2 kv heads, window 5 < context 10 split in 2.
    _check(np.random.default_rng(3), [10], 4, 2, 8, 4, 5, np.float32, splits=2)


def test_decode_splits_policy():
    assert decode_splits(128, 32, 8, 4096) == 1  # 1024 blocks already fill the GPU
    assert decode_splits(1, 32, 8, 256) == 1  # too short to split
    assert 1 < decode_splits(1, 32, 8, 32768) <= 128
    assert decode_splits(1, 32, 8, 4096) == 4096 // 256  # capped by the minimum part length


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize(
    "num_seqs,num_kv_heads,max_ctx,window",
    [(1, 8, 4096, 0), (1, 4, 32768, 0), (16, 8, 2048, 0), (64, 4, 1024, 0), (8, 8, 3000, 1024)],
)
def test_decode_gpu(dtype, num_seqs, num_kv_heads, max_ctx, window):
    rng = np.random.default_rng(num_seqs)
    lens = [int(x) for x in rng.integers(1, max_ctx + 1, num_seqs)]
    lens[0] = max_ctx
    splits = decode_splits(num_seqs, 32, num_kv_heads, max_ctx)
    _check(rng, lens, 32, num_kv_heads, 128, 16, window, dtype, splits, rtol=1e-4)
    if splits > 1:
        _check(rng, lens, 32, num_kv_heads, 128, 16, window, dtype, splits=1, rtol=1e-4)
