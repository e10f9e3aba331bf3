"""Decode linear kernels (plain, bias, fused residual, fused SwiGLU) vs numpy, in the simulator and (gpu) at
model sizes on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.linear import launch_linear, launch_swiglu
from expert_service.layers.moe import silu

from ._dense_helpers import WEIGHT_DTYPES, assert_close, gpu, nan_device, needs_gpu, random_weight


def _check_linear(rng, num_tokens, n, k, dtype, bias=False, accumulate=False, warps=None):
    x = rng.standard_normal((num_tokens, k), dtype=np.float32)
    w, wf = random_weight(rng, (n, k), dtype, scale=k ** -0.5)
    b, bf = random_weight(rng, (n,), dtype) if bias else (None, 0.0)
    want = x.astype(np.float64) @ wf.T.astype(np.float64) + bf
    if accumulate:
        base = rng.standard_normal((num_tokens, n), dtype=np.float32)
        out = cuda.to_device(base)
        want = want + base
    else:
        out = nan_device((num_tokens, n))
    launch_linear(cuda.to_device(x), cuda.to_device(w), out, bias=cuda.to_device(b) if bias else None,
                  accumulate=accumulate, warps=warps)
    assert_close(out.copy_to_host(), want, _rtol(dtype, k))


def _rtol(dtype, k):
    """Weights are exact in both; only float32 accumulation order differs (grows like sqrt(K))."""
    return (1e-5 if k < 1024 else 5e-5) if dtype is np.float32 else 1e-4


def _check_swiglu(rng, num_tokens, f, k, dtype, fused_matrix=False, warps=None):
    x = rng.standard_normal((num_tokens, k), dtype=np.float32)
    gu, guf = random_weight(rng, (2 * f, k), dtype, scale=k ** -0.5)
    want = silu(x @ guf[:f].T) * (x @ guf[f:].T)
    out = nan_device((num_tokens, f))
    d_gu = cuda.to_device(gu)
    if fused_matrix:
        launch_swiglu(cuda.to_device(x), d_gu, None, out, warps=warps)
    else:
        launch_swiglu(cuda.to_device(x), cuda.to_device(gu[:f].copy()), cuda.to_device(gu[f:].copy()), out,
                      warps=warps)
    assert_close(out.copy_to_host(), want, _rtol(dtype, k))


# Shapes: 1 token (token tile 1), 3 and 9 tokens (tile 8, partial second tile), odd N, K odd (scalar path),
# K % 4 == 0 (8-byte word path), K spanning two tiles with a short tail.
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("num_tokens,n,k", [(1, 5, 12), (3, 5, 21), (9, 2, 40)])
def test_linear_matches_reference(dtype, num_tokens, n, k):
    _check_linear(np.random.default_rng(n * k), num_tokens, n, k, dtype, warps=2 if n == 5 else 1)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_linear_bias_and_residual(dtype):
    rng = np.random.default_rng(1)
    _check_linear(rng, 1, 5, 16, dtype, bias=True, warps=1)
    _check_linear(rng, 2, 3, 9, dtype, bias=True, accumulate=True, warps=1)


@pytest.mark.parametrize("dtype,k", [(np.uint16, 1032), (np.float16, 517)])
def test_linear_multiple_k_tiles(dtype, k):
    _check_linear(np.random.default_rng(k), 1, 3, k, dtype, warps=1)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("num_tokens,f,k,fused", [(1, 3, 8, True), (2, 3, 13, False)])
def test_swiglu_matches_reference(dtype, num_tokens, f, k, fused):
    _check_swiglu(np.random.default_rng(f), num_tokens, f, k, dtype, fused_matrix=fused, warps=1)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(14336, 4096), (4096, 14336), (512, 2048), (151936, 2048), (1000, 1001)])
def test_linear_gpu(dtype, num_tokens, n, k):
    rng = np.random.default_rng(num_tokens)
    _check_linear(rng, num_tokens, n, k, dtype)
    if n < 20000:
        _check_linear(rng, num_tokens, n, k, dtype, bias=True, accumulate=True)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 16, 33, 64])
@pytest.mark.parametrize("f,k", [(14336, 4096), (768, 2048), (99, 257)])
def test_swiglu_gpu(dtype, num_tokens, f, k):
    _check_swiglu(np.random.default_rng(num_tokens), num_tokens, f, k, dtype, fused_matrix=num_tokens % 2 == 1)
