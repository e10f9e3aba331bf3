"""Embedding gather and RMSNorm / fused add+RMSNorm kernels vs numpy, in the simulator and (gpu) on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.norm import rms_norm
from expert_service.kernels.embedding import launch_embedding
from expert_service.kernels.rmsnorm import launch_add_rmsnorm, launch_rmsnorm
from tests.helpers import STORAGE_DTYPES, assert_close, nan_device, random_weight

EPS = 1e-6


def _check_embedding(rng, num_tokens, vocab, dim, dtype, threads):
    table, table_f = random_weight(rng, (vocab, dim), dtype)
    ids = rng.integers(0, vocab, num_tokens).astype(np.int32)
    out = nan_device((num_tokens, dim))
    launch_embedding(cuda.to_device(ids), cuda.to_device(table), out, threads=threads)
    np.testing.assert_array_equal(out.copy_to_host(), table_f[ids])  # a gather is exact


def _check_embedding_fed(rng, num_tokens, vocab, dim, dtype, threads):
    """Tokens fed from another step's argmax where feed >= 0 (ids there are stale and ignored); a fed id out of
    [0, vocab) reads row 0."""
    table, table_f = random_weight(rng, (vocab, dim), dtype)
    ids = rng.integers(0, vocab, num_tokens).astype(np.int32)
    fed = rng.integers(0, vocab, 7).astype(np.int32)
    fed[[2, 5]] = [-1, vocab]  # what a non-finite row's argmax could leave
    feed = np.where(rng.random(num_tokens) < 0.5, rng.integers(0, len(fed), num_tokens), -1).astype(np.int32)
    feed[:2] = [2, 5][:num_tokens]
    out = nan_device((num_tokens, dim))
    launch_embedding(
        cuda.to_device(ids),
        cuda.to_device(table),
        out,
        threads=threads,
        feed=cuda.to_device(feed),
        fed=cuda.to_device(fed),
    )
    expected = np.where(feed >= 0, fed[np.maximum(feed, 0)], ids)
    expected = np.where((expected >= 0) & (expected < vocab), expected, 0)
    np.testing.assert_array_equal(out.copy_to_host(), table_f[expected])


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_embedding_fed_from_another_steps_argmax(dtype):
    _check_embedding_fed(np.random.default_rng(), 9, 13, 40, dtype, threads=32)


def _check_rmsnorm(rng, shape, dtype, threads):
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(3.0)
    w, wf = random_weight(rng, (shape[-1],), dtype)
    out = nan_device(shape)
    launch_rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, out, threads=threads)
    assert_close(out.copy_to_host(), rms_norm(x, wf, EPS), 1e-5)


def _check_add_rmsnorm(rng, rows, n, dtype, threads):
    residual = rng.standard_normal((rows, n), dtype=np.float32)
    delta = rng.standard_normal((rows, n), dtype=np.float32)
    w, wf = random_weight(rng, (n,), dtype)
    d_res, out = cuda.to_device(residual), nan_device((rows, n))
    launch_add_rmsnorm(d_res, cuda.to_device(delta), cuda.to_device(w), EPS, out, threads=threads)
    assert_close(d_res.copy_to_host(), residual + delta, 0.0)
    assert_close(out.copy_to_host(), rms_norm(residual + delta, wf, EPS), 1e-5)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("num_tokens,dim", [(1, 7), (4, 37)])
def test_embedding_matches_reference(dtype, num_tokens, dim):
    _check_embedding(np.random.default_rng(dim), num_tokens, 11, dim, dtype, threads=32)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("shape", [(1, 45), (3, 70), (2, 3, 8)])  # (T, H, Hd): per-head q/k norm
def test_rmsnorm_matches_reference(dtype, shape):
    _check_rmsnorm(np.random.default_rng(shape[-1]), shape, dtype, threads=32 if len(shape) == 3 else 64)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 33), (3, 70)])
def test_add_rmsnorm_matches_reference(dtype, rows, n):
    _check_add_rmsnorm(np.random.default_rng(n), rows, n, dtype, threads=64)


def test_rmsnorm_in_place():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 40), dtype=np.float32)
    d_x = cuda.to_device(x)
    launch_rmsnorm(d_x, cuda.to_device(np.ones(40, np.float32)), EPS, d_x, threads=32)
    assert_close(d_x.copy_to_host(), rms_norm(x, np.ones(40, np.float32), EPS), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 33, 512])
def test_embedding_rmsnorm_gpu(dtype, num_tokens):
    rng = np.random.default_rng(num_tokens)
    for dim in (4096, 2048, 1001):
        _check_embedding(rng, num_tokens, 5000, dim, dtype, threads=128)
        _check_embedding_fed(rng, num_tokens, 5000, dim, dtype, threads=128)
        _check_rmsnorm(rng, (num_tokens, dim), dtype, threads=256)
        _check_add_rmsnorm(rng, num_tokens, dim, dtype, threads=256)
    _check_rmsnorm(rng, (num_tokens, 32, 128), dtype, threads=256)


# Every shape (the warp / block kernel boundary, idle warps, N not a multiple of 32) in float32; the weight's
# storage dtype only changes its load, the same in both kernels, so the others run one shape of each kernel.
SHORT_ROW_SHAPES = [(1, 1), (5, 31), (3, 33), (4, 128), (3, 200), (2, 257), (3, 1000), (2, 1024), (2, 1025)]
SHORT_ROW_CASES = [(np.float32, rows, n) for rows, n in SHORT_ROW_SHAPES] + [
    (dtype, rows, n) for dtype in STORAGE_DTYPES if dtype is not np.float32 for rows, n in ((5, 31), (2, 1025))
]


@pytest.mark.parametrize("dtype,rows,n", SHORT_ROW_CASES)
def test_short_rows_take_a_warp_each_and_give_the_block_kernels_bits(dtype, rows, n, monkeypatch):
    """Rows of at most WARP_ROW_MAX elements take the warp-per-row kernel (row counts that leave a block's last
    warps idle, N not a multiple of 32), longer rows the block kernel: the numpy result within float32 rounding,
    every element written, and the same bits as the block kernel with THREADS threads."""
    import expert_service.kernels.rmsnorm as rmsnorm

    rng = np.random.default_rng(rows * 10000 + n)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w, wf = random_weight(rng, (n,), dtype)
    auto, full = nan_device((rows, n)), nan_device((rows, n))
    rmsnorm.launch_rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, full, threads=rmsnorm.THREADS)
    monkeypatch.setattr(rmsnorm, "WARP_KERNEL_MIN_ROWS", 0)  # on a GPU, so few rows take the block kernel
    if n <= rmsnorm.WARP_ROW_MAX:  # the default must not fall back to the block kernel
        monkeypatch.setattr(rmsnorm, "_build", None)
    rmsnorm.launch_rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, auto)
    got = auto.copy_to_host()
    assert_close(got, rms_norm(x, wf, EPS), 1e-5)
    np.testing.assert_array_equal(got, full.copy_to_host())


@pytest.mark.parametrize("rows,n", [(3, 33), (4, 128), (2, 1000)])
def test_few_short_rows_take_the_block_kernel_with_a_thread_per_element(rows, n, monkeypatch):
    """Below WARP_KERNEL_MIN_ROWS rows (decode steps) the block kernel runs with ceil(N / 32) warps: the same bits
    as with THREADS threads."""
    import expert_service.kernels.rmsnorm as rmsnorm

    monkeypatch.setattr(rmsnorm, "WARP_KERNEL_MIN_ROWS", rows + 1)
    monkeypatch.setattr(rmsnorm, "_build_short", None)
    rng = np.random.default_rng(rows + n)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w, _ = random_weight(rng, (n,), np.float32)
    auto, full = nan_device((rows, n)), nan_device((rows, n))
    rmsnorm.launch_rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, full, threads=rmsnorm.THREADS)
    rmsnorm.launch_rmsnorm(cuda.to_device(x), cuda.to_device(w), EPS, auto)
    np.testing.assert_array_equal(auto.copy_to_host(), full.copy_to_host())


def test_short_rows_in_place_per_head():
    """The q/k norm call: a [T, H, Hd] view normalised per head, in place, rows not a multiple of a block's."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5, 64), dtype=np.float32)
    w = rng.standard_normal(64, dtype=np.float32)
    d_x = cuda.to_device(x)
    launch_rmsnorm(d_x, cuda.to_device(w), EPS, d_x)
    assert_close(d_x.copy_to_host(), rms_norm(x, w, EPS), 1e-5)
