"""attention_decode kernel vs expert_service.cpu.layers.attention.paged_attention (one query per sequence)."""

from __future__ import annotations

import numpy as np
import pytest

from expert_service.kernels.attention_decode import decode_splits, launch_attention_decode
from tests.helpers import STORAGE_DTYPES, check_decode_attention


def _check(rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, dtype, splits, rtol=1e-5, **kw):
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
        **kw,
    )


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_gqa_mixed_lengths_split(dtype):
    # 2 query heads on 1 kv head, Hd=20 (not a multiple of 32), contexts 1..9, 3 equal parts of any size (some
    # empty for ctx=1).
    _check(np.random.default_rng(1), [1, 9, 6], 2, 1, 20, 4, 0, dtype, splits=3, min_keys=1)


def test_mqa_sliding_window_no_split():
    # 3 query heads on one kv head, window 3 < context, non-contiguous blocks.
    _check(np.random.default_rng(2), [7, 2], 3, 1, 24, 2, 3, np.uint16, splits=1)


def test_gqa_window_with_split():
    # 4 query heads over 2 kv heads, window 5 < context 10 split in 2.
    _check(np.random.default_rng(3), [10], 4, 2, 8, 4, 5, np.float32, splits=2, min_keys=1)


@pytest.mark.parametrize("min_keys", [4, 64])
def test_parts_follow_each_context(min_keys):
    """Up to 6 parts of at least min_keys keys, from each sequence's own context: 0 (an idle slot), 1 and 4 (one
    part: its block writes the output, the reduce skips it), 5, 13 and 24 (2, 4 and 6 parts at min_keys 4), a
    window of 9 over 24; at min_keys 64 every one of them takes a single part."""
    rng = np.random.default_rng(4)
    _check(rng, [0, 1, 4, 5, 13, 24], 4, 2, 16, 4, 0, np.uint16, splits=6, min_keys=min_keys)
    _check(rng, [24, 3], 4, 2, 16, 4, 9, np.float32, splits=6, min_keys=min_keys)


def test_part_range_cuts_each_context_into_parts_of_at_least_min_keys():
    from expert_service.kernels.attention_decode import part_range

    def parts(n, splits, min_keys, window=0):
        cut = [part_range.py_func(n, n - 1, window, p, splits, min_keys) for p in range(splits)]
        count = cut[0][2]
        assert all(c[2] == count for c in cut)
        ranges = [(lo, hi) for lo, hi, _ in cut if lo < hi]
        assert len(ranges) == count and all(hi > lo for lo, hi in ranges)
        keys = [k for lo, hi in ranges for k in range(lo, hi)]
        assert keys == list(range(max(0, n - window) if window else 0, n))  # every key once, in order
        return [hi - lo for lo, hi in ranges]

    assert parts(128, 66, 64) == [64, 64]  # a one-sequence step's 66 parts: two of 64 at 128 keys
    assert parts(4096, 66, 64) == [64] * 64  # 66 allowed, 64 of the fewest keys needed
    assert parts(8192, 66, 64) == [125] * 65 + [8192 - 65 * 125]  # then equal parts of ceil(8192 / 66)
    assert parts(100, 4, 64) == [64, 36] and parts(64, 4, 64) == [64] and parts(0, 4, 64) == []
    assert parts(10, 3, 1) == [4, 4, 2]  # min_keys 1: equal parts of the context, as before
    assert parts(30, 8, 4, window=9) == [4, 4, 1]


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
