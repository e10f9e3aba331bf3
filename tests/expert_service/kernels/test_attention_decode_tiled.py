"""attention_decode_tiled vs expert_service.cpu.layers.attention.paged_attention (one query per sequence), and the
fastest-kernel choice. Contexts span several 32-key tiles (cp.async double buffering) and partial last tiles."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.attention_decode_tiled import (
    launch_attention_decode_fastest,
    launch_attention_decode_tiled,
    supports,
)
from tests.helpers import check_decode_attention, nan_device


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


def _merge_inputs(rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, splits):
    from tests.helpers import random_cache

    need = sum(-(-c // block_size) for c in context_lens)
    k_pool, v_pool, tables, _ = random_cache(rng, context_lens, need + 3, block_size, num_kv_heads, head_dim, np.uint16)
    num_seqs = len(context_lens)
    ctx = np.asarray(context_lens, dtype=np.int32)
    q = rng.standard_normal((num_seqs, num_heads, head_dim), dtype=np.float32)
    arrays = [cuda.to_device(a) for a in (q, k_pool, v_pool, tables, ctx, ctx - 1)]
    parts = [nan_device((num_seqs, num_heads, splits, n)) for n in (head_dim, 2)]
    return arrays, parts


@pytest.mark.parametrize("window", [0, 33])
def test_merge_in_kernel_gives_the_reduce_launchs_bits(window):
    # parts of 1, 2, 3 and 4 per sequence (min_keys 16: 100 keys in 4, 40 in 3, 20 in 2, 9 in one) and an idle slot:
    # the last part to finish merges (tickets), in the reduce kernel's order, so the outputs match it bit for bit;
    # the tickets are zero again after every launch, so a second launch (a graph replay) merges again
    rng = np.random.default_rng(7 + window)
    lens, heads, kv_heads, hd, bs, splits = [100, 40, 20, 9, 0], 8, 2, 64, 8, 4
    arrays, parts = _merge_inputs(rng, lens, heads, kv_heads, hd, bs, splits)
    plain = nan_device((len(lens), heads, hd))
    launch_attention_decode_tiled(*arrays, window, hd**-0.5, plain, *parts, min_keys=16)
    tickets = cuda.to_device(np.zeros(len(lens) * heads, np.int32))
    for _ in range(2):
        merged = nan_device((len(lens), heads, hd))
        parts = [nan_device(p.shape) for p in parts]
        launch_attention_decode_tiled(*arrays, window, hd**-0.5, merged, *parts, min_keys=16, tickets=tickets)
        np.testing.assert_array_equal(merged.copy_to_host(), plain.copy_to_host())
        assert not tickets.copy_to_host().any()
    # and against the reference, through the shared checker
    _check(
        rng,
        lens,
        heads,
        kv_heads,
        hd,
        bs,
        window,
        splits,
        launch_attention_decode_tiled,
        min_keys=16,
        tickets=cuda.to_device(np.zeros(len(lens) * heads, np.int32)),
    )


def test_merge_in_kernel_refuses_a_short_ticket_buffer():
    arrays, parts = _merge_inputs(np.random.default_rng(8), [40, 30], 4, 1, 64, 8, 2)
    with pytest.raises(ValueError, match=r"tickets must be int32 \[>= 2\]"):
        launch_attention_decode_tiled(
            *arrays,
            0,
            0.125,
            nan_device((2, 4, 64)),
            *parts,
            min_keys=16,
            tickets=cuda.to_device(np.zeros(1, np.int32)),
        )


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
    # the parts merged in the kernel (tickets): the same check
    tickets = cuda.to_device(np.zeros(num_seqs * 32, np.int32))
    _check(
        rng, lens, 32, num_kv_heads, 128, 16, window, splits, launch_attention_decode_tiled, rtol=1e-4, tickets=tickets
    )
    assert not tickets.copy_to_host().any()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(128, 32, 4), (64, 8, 8)])
def test_merge_in_kernel_relaunched_on_the_gpu(head_dim, heads, kv_heads):
    # real blocks finishing in any order, partials NaN before each launch: every relaunch gives the reduce launch's
    # bits and leaves the tickets zero; one-head groups (64 x 8 x 8) put four slots' (max, sum) in one cache line
    rng = np.random.default_rng(head_dim + heads)
    lens = [int(x) for x in rng.integers(1, 1200, 7)] + [0, 1100]
    arrays, parts = _merge_inputs(rng, lens, heads, kv_heads, head_dim, 16, 8)
    plain = nan_device((len(lens), heads, head_dim))
    launch_attention_decode_tiled(*arrays, 0, head_dim**-0.5, plain, *parts, min_keys=64)
    want = plain.copy_to_host()
    tickets = cuda.to_device(np.zeros(len(lens) * heads, np.int32))
    for launch in range(40):
        out = nan_device(want.shape)
        parts = [nan_device(p.shape) for p in parts]
        launch_attention_decode_tiled(*arrays, 0, head_dim**-0.5, out, *parts, min_keys=64, tickets=tickets)
        assert np.array_equal(out.copy_to_host(), want), launch
        assert not tickets.copy_to_host().any(), launch
