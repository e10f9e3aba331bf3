"""RoPE and greedy argmax / non-finite flag kernels vs numpy, in the simulator and (gpu) on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.rope import apply_rotary
from expert_service.kernels.greedy import launch_greedy
from expert_service.kernels.rope import launch_rope
from tests.helpers import assert_close, nan_device


def _reference_rope(x, positions, inv_freq, scale):
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos = (np.cos(emb) * np.float32(scale)).astype(np.float32)
    sin = (np.sin(emb) * np.float32(scale)).astype(np.float32)
    return apply_rotary(x, cos, sin)


def _check_rope(rng, num_tokens, heads, kv_heads, head_dim, scale, max_pos, threads):
    q = rng.standard_normal((num_tokens, heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((num_tokens, kv_heads, head_dim), dtype=np.float32)
    positions = rng.integers(0, max_pos, num_tokens).astype(np.int32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    d_q, d_k = cuda.to_device(q), cuda.to_device(k)
    launch_rope(d_q, d_k, cuda.to_device(positions), cuda.to_device(inv_freq), scale, threads=threads)
    assert_close(d_q.copy_to_host(), _reference_rope(q, positions, inv_freq, scale), 1e-5)
    assert_close(d_k.copy_to_host(), _reference_rope(k, positions, inv_freq, scale), 1e-5)


def _check_greedy(rng, rows, vocab, threads):
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    logits[0, rng.integers(vocab, size=3)] = np.float32(7.5)  # tie: lowest index wins
    if rows > 1:
        logits[1, vocab - 1] = np.inf
    if rows > 2:
        logits[2, 0] = np.nan
    ids, flags = nan_device(rows, np.int32), nan_device(rows, np.int32)
    launch_greedy(cuda.to_device(logits), ids, flags, threads=threads)
    want_flags = (~np.isfinite(logits)).any(axis=1).astype(np.int32)
    want_ids = np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=1).astype(np.int32)
    np.testing.assert_array_equal(flags.copy_to_host(), want_flags)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)


@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,scale", [(1, 2, 1, 8, 1.0), (3, 3, 1, 12, 1.3)])
def test_rope_matches_reference(num_tokens, heads, kv_heads, head_dim, scale):
    _check_rope(np.random.default_rng(head_dim), num_tokens, heads, kv_heads, head_dim, scale, 5000, threads=32)


@pytest.mark.parametrize("rows,vocab", [(1, 37), (3, 100)])
def test_greedy_matches_reference(rows, vocab):
    _check_greedy(np.random.default_rng(vocab), rows, vocab, threads=32)


def test_greedy_all_negative_infinity():
    ids, flags = nan_device(1, np.int32), nan_device(1, np.int32)
    launch_greedy(cuda.to_device(np.full((1, 40), -np.inf, np.float32)), ids, flags, threads=32)
    assert ids.copy_to_host()[0] == 0 and flags.copy_to_host()[0] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 33, 4096])
def test_rope_gpu(num_tokens):
    rng = np.random.default_rng(num_tokens)
    _check_rope(rng, num_tokens, 32, 8, 128, 1.0, 131072, threads=128)
    _check_rope(rng, num_tokens, 32, 4, 64, 1.2, 4096, threads=128)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_greedy_gpu(rows):
    rng = np.random.default_rng(rows)
    for vocab in (32000, 151936, 1001):
        _check_greedy(rng, rows, vocab, threads=256)
