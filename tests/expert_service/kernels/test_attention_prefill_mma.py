"""attention_prefill_mma (tensor cores, bf16 pools) vs expert_service.cpu.layers.attention.paged_attention and vs the
fp32 launch_attention_prefill kernel; launch_attention_prefill_fastest falls back to launch_attention_prefill where mma
cannot run. Runs under the CUDA simulator too (block_mma emulates the mma exactly), so CI checks the fragment,
swizzle and masking indexing on small shapes; the GPU tests take the real ones.

Tolerance: RTOL = 1e-2 of max |reference|. The kernel rounds q * scale and the softmax weights P to bf16
(relative step 2**-8, so up to 2e-3 per value) before the tensor-core products; errors measured in an emulation of
the kernel were ~2e-3. The pools hold bf16 values exactly, so the fp32 kernel itself is within 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.attention import paged_attention
from expert_service.kernels import attention_prefill_mma as mma_module
from expert_service.kernels.attention_prefill import launch_attention_prefill
from expert_service.kernels.attention_prefill_mma import (
    launch_attention_prefill_fastest,
    launch_attention_prefill_mma,
    supports,
)
from tests.helpers import assert_close, from_storage, random_cache

RTOL = 1e-2


def _inputs(rng, new_tokens, history, num_heads, num_kv_heads, head_dim, block_size, later=0):
    """Random bf16 pools holding `history[s] + new_tokens[s] + later` tokens per sequence (`later` keys past the
    last new token, which causality hides), q for the new tokens."""
    ctx = np.asarray(history, dtype=np.int32) + np.asarray(new_tokens, dtype=np.int32) + np.int32(later)
    need = sum(-(-int(c) // block_size) for c in ctx)
    k_pool, v_pool, tables, lists = random_cache(rng, ctx, need + 3, block_size, num_kv_heads, head_dim, np.uint16)
    seq_starts = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    positions = np.concatenate([np.arange(h, h + n) for h, n in zip(history, new_tokens)]).astype(np.int32)
    q = rng.standard_normal((int(seq_starts[-1]), num_heads, head_dim), dtype=np.float32)
    return q, k_pool, v_pool, seq_starts, positions, tables, ctx, lists


def _run(launch, q, k_pool, v_pool, seq_starts, positions, tables, ctx, window, scale):
    out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float32))  # every element must be written
    launch(
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
    return out.copy_to_host()


def _check(seed, new_tokens, history, num_heads, num_kv_heads, head_dim, window=0, block_size=16):
    assert supports(np.uint16, head_dim, block_size)  # launch_attention_prefill_fastest takes the tensor-core path
    q, k_pool, v_pool, seq_starts, positions, tables, ctx, lists = _inputs(
        np.random.default_rng(seed), new_tokens, history, num_heads, num_kv_heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    want = paged_attention(
        q, from_storage(k_pool), from_storage(v_pool), seq_starts, ctx, lists, positions, scale, window
    )
    args = (q, k_pool, v_pool, seq_starts, positions, tables, ctx, window, scale)
    got = _run(launch_attention_prefill_fastest, *args)
    assert_close(got, want, RTOL)
    assert_close(got, _run(launch_attention_prefill, *args), RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_long_sequence(head_dim):
    _check(1, [512], [0], 32, 8, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (16, 4), (32, 4)])  # GQA 1, 4, 8
def test_awkward_lengths_gqa(head_dim, num_heads, num_kv_heads):
    _check(2, [1, 33, 100, 17], [0, 0, 0, 0], num_heads, num_kv_heads, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunked_prefill(head_dim):
    # Later chunks of prompts whose earlier tokens are in the pool; a sequence with no new tokens; block size 8.
    _check(3, [256, 0, 100, 1], [512, 7, 37, 64], 32, 8, head_dim, block_size=8)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [1, 100])
def test_sliding_window(head_dim, window):
    _check(4, [300, 64, 5], [200, 0, 150], 16, 4, head_dim, window=window)


@pytest.mark.gpu
def test_many_sequences():
    _check(5, [128] * 16, [0] * 16, 32, 8, 128)


@pytest.mark.gpu
def test_more_sequences_than_threads():
    # 150 sequences (the block -> sequence walk reads tile counts in chunks of THREADS) of 1-5 new tokens.
    rng = np.random.default_rng(7)
    _check(7, list(rng.integers(1, 6, 150)), list(rng.integers(0, 40, 150)), 8, 2, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 32])
def test_small_head_sizes(head_dim):
    _check(9, [130, 7], [60, 3], 8, 2, head_dim, window=70)


@pytest.mark.gpu
def test_chunks_over_a_long_cached_prefix():
    # the turns step of a prefix-caching round: 16 sequences of 64 new tokens over 2,048 cached ones
    _check(10, [64] * 16, [2048] * 16, 32, 8, 128)


def _check_uniform(seed, new_tokens, history, num_heads, num_kv_heads, head_dim, window=0, block_size=16, later=0):
    """q = 0 makes every allowed key's weight exactly 1 (bf16 P included), so the output is the mean of the allowed
    V rows to fp32 rounding: at 1e-4 one key let through or kept out of any row's range fails, which the random-q
    tolerance cannot see over hundreds of keys."""
    q, k_pool, v_pool, seq_starts, positions, tables, ctx, lists = _inputs(
        np.random.default_rng(seed), new_tokens, history, num_heads, num_kv_heads, head_dim, block_size, later
    )
    q[:] = 0.0
    want = paged_attention(
        q, from_storage(k_pool), from_storage(v_pool), seq_starts, ctx, lists, positions, 1.0, window
    )
    got = _run(launch_attention_prefill_mma, q, k_pool, v_pool, seq_starts, positions, tables, ctx, window, 1.0)
    assert_close(got, want, 1e-4)


def test_simulated_uniform_weights_find_every_range_bound():
    # keys past the last position in the pool, a window starting mid-tile, blocks of 2, GQA 4, two query tiles
    _check_uniform(14, [70, 3, 0], [45, 130, 6], 4, 1, 16, window=37, block_size=2, later=9)


def test_simulated_uniform_weights_head_dim_64_one_key_blocks():
    _check_uniform(15, [20, 1], [100, 64], 2, 2, 64, block_size=1, later=5)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 300])
def test_uniform_weights_over_long_prefixes(head_dim, window):
    # 16 sequences of 64 new tokens over 2,048 cached ones (and 150 over 700): every causal / window bound exact
    _check_uniform(16, [64] * 16 + [150], [2048] * 16 + [700], 32, 8, head_dim, window=window, later=11)


@pytest.mark.gpu
def test_uniform_weights_more_sequences_than_threads_block_sizes():
    rng = np.random.default_rng(17)
    for block_size in (1, 32, 64):
        _check_uniform(18, list(rng.integers(0, 40, 140)), list(rng.integers(0, 90, 140)), 8, 2, 32, 0, block_size, 3)


def test_simulated_chunks_gqa_and_an_empty_sequence():
    # Hd 16 (one k-step, 64-key tiles): a sequence of two query tiles after a cached prefix (causal mask inside
    # tiles, a warp past the last row), a short one, one with no new tokens; blocks of 4 keys, 2 heads a kv head
    _check(11, [5, 70, 0], [3, 20, 9], 4, 2, 16, block_size=4)


def test_simulated_window():
    # Hd 32 with a sliding window narrower than a tile (tiles before a row's window skipped or masked)
    _check(12, [40, 9], [50, 0], 2, 1, 32, window=19, block_size=8)


def test_simulated_head_dim_128():
    # the 32-key tiles and 16 k-steps of Hd 128, one query head, 2 tiles of keys
    _check(13, [21], [30], 1, 1, 128, block_size=16)


def test_supports():
    for dtype, head_dim, block_size in [
        (np.float32, 128, 16),
        (np.float16, 128, 16),
        (np.uint16, 20, 16),
        (np.uint16, 256, 16),
        (np.uint16, 96, 16),
        (np.uint16, 128, 12),
    ]:
        assert not supports(dtype, head_dim, block_size)
    assert supports(np.uint16, 128, 16) and supports(np.uint16, 16, 1) and supports(np.uint16, 64, 32)


def test_launcher_refuses_what_it_cannot_run():
    q, k_pool, v_pool, seq_starts, positions, tables, ctx, _ = _inputs(np.random.default_rng(6), [3], [0], 2, 1, 16, 4)
    args = (q, k_pool.astype(np.float16), v_pool.astype(np.float16), seq_starts, positions, tables, ctx, 0, 0.25)
    with pytest.raises(ValueError, match="no kernel for float16 pools"):
        _run(launch_attention_prefill_mma, *args)


def test_misaligned_arrays_are_refused_or_take_the_fp32_kernel(monkeypatch):
    # q as a view one float past a 16-byte boundary: the tensor-core kernel's 16-byte loads cannot read it
    q, k_pool, v_pool, seq_starts, positions, tables, ctx, lists = _inputs(
        np.random.default_rng(8), [3, 2], [0, 4], 2, 1, 16, 4
    )
    backing = cuda.to_device(np.concatenate([[0.0], q.reshape(-1)]).astype(np.float32))
    q_view = backing[1:].reshape(q.shape)
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    args = [cuda.to_device(a) for a in (k_pool, v_pool, seq_starts, positions, tables, ctx)]
    with pytest.raises(ValueError, match="start on 16 bytes"):
        launch_attention_prefill_mma(q_view, *args[:2], *args[2:], 0, 0.25, out)
    calls = []

    def spy(*a):
        calls.append(a)
        launch_attention_prefill(*a)

    monkeypatch.setattr(mma_module, "launch_attention_prefill", spy)
    launch_attention_prefill_fastest(q_view, *args, 0, 0.25, out)
    want = paged_attention(q, from_storage(k_pool), from_storage(v_pool), seq_starts, ctx, lists, positions, 0.25, 0)
    assert len(calls) == 1
    assert_close(out.copy_to_host(), want, 1e-5)


def test_fastest_falls_back_without_mma(monkeypatch):
    # A bf16 pool with a head size the tensor-core kernel has no tiles for (20) goes to the fp32 kernel, with its
    # exact results.
    calls = []

    def spy(*args):
        calls.append(args)
        launch_attention_prefill(*args)

    monkeypatch.setattr(mma_module, "launch_attention_prefill", spy)
    q, k_pool, v_pool, seq_starts, positions, tables, ctx, lists = _inputs(
        np.random.default_rng(6), [3, 2], [0, 4], 2, 1, 20, 4
    )
    want = paged_attention(q, from_storage(k_pool), from_storage(v_pool), seq_starts, ctx, lists, positions, 0.25, 0)
    got = _run(launch_attention_prefill_fastest, q, k_pool, v_pool, seq_starts, positions, tables, ctx, 0, 0.25)
    assert len(calls) == 1
    assert_close(got, want, 1e-5)
