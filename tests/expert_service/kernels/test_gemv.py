"""One-token GEMV kernels (plain, bias, fused residual, SwiGLU both forms, routed experts) vs numpy in float64:
simulator on tiny fresh random shapes that reach the unrolled main loop, the partial last step, K splits and
the scalar fallback; (gpu) model sizes. Outputs start as NaN, so every element must be written."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.moe import silu
from expert_service.kernels.gemv import (
    LaunchShape,
    launch_expert_down,
    launch_expert_gate_up,
    launch_gemv,
    launch_gemv_swiglu,
    launch_shape_for,
)
from tests.helpers import STORAGE_DTYPES, assert_close, expert_buffer, nan_device, random_weight

# (rows, split, groups): default shape, then K split over warps with several row groups per block
_PLANS = [None, LaunchShape(2, 2, 2), LaunchShape(4, 1, 2)]


def _rtol(k):
    """Weights are exact in both; only float32 accumulation order differs (grows like sqrt(K))."""
    return 2e-5 if k < 1024 else 1e-4


def _check_gemv(rng, n, k, dtype, bias=False, accumulate=False, shape=None, offset=0):
    x = rng.standard_normal((1, k), dtype=np.float32)
    w, wf = random_weight(rng, (n, k), dtype, scale=k**-0.5)
    b, bf = random_weight(rng, (n,), dtype) if bias else (None, 0.0)
    want = x.astype(np.float64) @ wf.T.astype(np.float64) + bf
    if accumulate:
        base = rng.standard_normal((1, n), dtype=np.float32)
        out = cuda.to_device(base)
        want = want + base
    else:
        out = nan_device((1, n))
    if offset:  # weight starting `offset` elements into an allocation: not 16-byte aligned
        d_w = cuda.to_device(np.concatenate([np.zeros(offset, w.dtype), w.reshape(-1)]))[offset:].reshape(n, k)
    else:
        d_w = cuda.to_device(w)
    launch_gemv(
        cuda.to_device(x), d_w, out, bias=cuda.to_device(b) if bias else None, accumulate=accumulate, shape=shape
    )
    assert_close(out.copy_to_host(), want, _rtol(k))


def _check_swiglu(rng, f, k, dtype, fused_matrix, shape=None):
    x = rng.standard_normal((1, k), dtype=np.float32)
    gu, guf = random_weight(rng, (2 * f, k), dtype, scale=k**-0.5)
    x64 = x.astype(np.float64)
    want = silu(x64 @ guf[:f].T.astype(np.float64)) * (x64 @ guf[f:].T.astype(np.float64))
    out = nan_device((1, f))
    if fused_matrix:
        launch_gemv_swiglu(cuda.to_device(x), cuda.to_device(gu), None, out, shape=shape)
    else:
        launch_gemv_swiglu(
            cuda.to_device(x), cuda.to_device(gu[:f].copy()), cuda.to_device(gu[f:].copy()), out, shape=shape
        )
    assert_close(out.copy_to_host(), want, _rtol(k))


def _check_experts(rng, ids, n_exp, F, D, dtype, shape=None, down_plan=None, unpadded=False):
    """unpadded: experts [E, 3FD] without expert_buffer's NaN padding (mixtral sizes: a quarter of its host
    work)."""
    if unpadded:
        W, exact = random_weight(rng, (n_exp, 3 * F * D), dtype, scale=D**-0.5)
        mats = [
            (e[: F * D].reshape(F, D), e[F * D : 2 * F * D].reshape(F, D), e[2 * F * D :].reshape(D, F)) for e in exact
        ]
    else:
        W, mats = expert_buffer(rng, n_exp, F, D, dtype, scale=D**-0.5)
    x = rng.standard_normal((1, D), dtype=np.float32)
    top_k = ids.shape[1]
    h, y = nan_device((top_k, F)), nan_device((top_k, D))
    d_w, d_ids = cuda.to_device(W), cuda.to_device(ids)
    launch_expert_gate_up(cuda.to_device(x), d_ids, d_w, F, D, h, shape=shape)
    launch_expert_down(h, d_ids, d_w, F, D, y, shape=down_plan)
    h, y = h.copy_to_host(), y.copy_to_host()
    x64 = x.astype(np.float64)
    want_h = np.concatenate(
        [silu(x64 @ mats[e][0].T.astype(np.float64)) * (x64 @ mats[e][1].T.astype(np.float64)) for e in ids[0]]
    )
    want_y = np.stack([h[i].astype(np.float64) @ mats[e][2].T.astype(np.float64) for i, e in enumerate(ids[0])])
    assert_close(h, want_h, _rtol(max(F, D)))
    assert_close(y, want_y, _rtol(max(F, D)))


# K = 40 / 1032: 16-byte path (bf16, f16 and f32 rows aligned); 1032 bf16 = 129 chunks -> two full unrolled
# steps (2 x 32 lanes x 2 chunks in the simulator) plus a partial one; K = 36: f32 wide, 16-bit scalar;
# K = 37: scalar for all. N = 1, 3, 5, 7: odd and below a row group.
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("n,k", [(5, 40), (7, 37), (3, 1032), (1, 36)])
def test_gemv_matches_reference(dtype, n, k):
    _check_gemv(np.random.default_rng(n * k), n, k, dtype)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("shape", _PLANS[1:])
def test_gemv_split_and_row_groups(dtype, shape):
    _check_gemv(np.random.default_rng(3), 9, 520, dtype, shape=shape)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_gemv_bias_and_residual(dtype):
    rng = np.random.default_rng(1)
    _check_gemv(rng, 5, 16, dtype, bias=True)
    _check_gemv(rng, 3, 9, dtype, bias=True, accumulate=True)
    _check_gemv(rng, 6, 48, dtype, accumulate=True, shape=LaunchShape(1, 2, 1))


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("f,k,fused", [(3, 16, True), (5, 13, False), (4, 72, False)])
def test_gemv_swiglu_matches_reference(dtype, f, k, fused):
    _check_swiglu(np.random.default_rng(f * k), f, k, dtype, fused)


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_gemv_swiglu_split(dtype):
    _check_swiglu(np.random.default_rng(5), 3, 264, dtype, True, shape=LaunchShape(1, 2, 2))


# (F, D) = (6, 40): gate/up rows 16-byte aligned for every dtype, down rows (F) scalar; (8, 36) the reverse
# for 16-bit. Ids: K = 2, and K = 3 with a repeated expert.
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("ids,F,D", [([[3, 1]], 6, 40), ([[2, 2, 0]], 8, 36)])
def test_experts_match_reference(dtype, ids, F, D):
    _check_experts(np.random.default_rng(F * D), np.array(ids, np.int32), 4, F, D, dtype)


def test_experts_split_plan():
    # gate/up: K split over 2 warps (D = 132 f32 = 33 chunks); down: 4 rows x 4 groups (fewer simulated threads)
    _check_experts(
        np.random.default_rng(9),
        np.array([[1, 1]], np.int32),
        2,
        8,
        132,
        np.float32,
        shape=LaunchShape(1, 2, 1),
        down_plan=LaunchShape(4, 1, 4),
    )


def test_plan_fills_the_gpu():
    """Small N splits K over warps; large N keeps 4 rows per warp; each warp has >= 32 chunks."""
    assert launch_shape_for(8, 512, 1, False) == LaunchShape(1, 16, 1)  # N = 8 router, K = 4096 bf16
    assert launch_shape_for(128, 256, 1, False) == LaunchShape(1, 8, 1)  # N = 128 router, K = 2048
    assert launch_shape_for(32000, 512, 1, False).rows == 4
    for n, chunks, slots, gated in ((1024, 512, 1, False), (4096, 512, 1, False), (768, 256, 8, True)):
        p = launch_shape_for(n, chunks, slots, gated)
        assert -(-n // p.rows) * slots * p.split >= 2048 and chunks // p.split >= 32, p


# ---- model sizes on a GPU (mixtral: D=4096, F=14336, V=32000; qwen3: D=2048, F=768, K=8 of E=128) ----
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize(
    "n,k", [(4096, 4096), (1024, 4096), (8, 4096), (128, 2048), (4096, 2048), (2048, 4096), (1001, 1001)]
)
def test_gemv_gpu(dtype, n, k):
    rng = np.random.default_rng(n + k)
    _check_gemv(rng, n, k, dtype)
    _check_gemv(rng, n, k, dtype, bias=True, accumulate=True)


@pytest.mark.gpu
def test_gemv_gpu_lm_head_and_unaligned():
    rng = np.random.default_rng(0)
    _check_gemv(rng, 32000, 4096, np.uint16)
    _check_gemv(rng, 999, 4096, np.uint16, offset=1)  # unaligned rows: scalar fallback
    _check_gemv(rng, 999, 4096, np.float32, offset=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("f,k", [(14336, 4096), (768, 2048), (99, 257)])
def test_gemv_swiglu_gpu(dtype, f, k):
    _check_swiglu(np.random.default_rng(f), f, k, dtype, fused_matrix=f % 2 == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_experts_gpu_qwen3(dtype):
    # 16 experts stand in for 128 (the kernel only offsets by id); K = 8 with a repeat
    ids = np.array([[15, 3, 3, 7, 0, 9, 12, 5]], np.int32)
    _check_experts(np.random.default_rng(8), ids, 16, 768, 2048, dtype)


@pytest.mark.gpu
def test_experts_gpu_mixtral():
    _check_experts(np.random.default_rng(2), np.array([[1, 0]], np.int32), 2, 14336, 4096, np.uint16, unpadded=True)
