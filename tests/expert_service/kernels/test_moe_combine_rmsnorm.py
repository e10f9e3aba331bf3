"""moe_combine_rmsnorm vs numpy (experts.combine + residual, then rms_norm) and bit for bit vs the unfused pair
moe_combine (or moe_combine_dense) + rmsnorm, grouped and dense layouts, in the simulator and (gpu) on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.norm import rms_norm
from expert_service.experts.grouping import combine, group_by_expert
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_combine_dense import launch_moe_combine_dense
from expert_service.kernels.moe_combine_rmsnorm import launch_moe_combine_rmsnorm
from expert_service.kernels.rmsnorm import launch_rmsnorm
from tests.helpers import STORAGE_DTYPES, assert_close, nan_device, random_ids, random_weight

EPS = 1e-5


def _check(rng, n_tok, top_k, n_exp, D, dtype, dense, threads):
    ids = random_ids(rng, n_tok, top_k, n_exp)
    weights = rng.random((n_tok, top_k)).astype(np.float32)
    hidden = rng.standard_normal((n_tok, D)).astype(np.float32)
    norm_w, norm_wf = random_weight(rng, (D,), dtype)
    if dense:
        y = rng.standard_normal((n_exp, n_tok, D)).astype(np.float32)
        index = ids
        delta = np.einsum("tk,tkd->td", weights, y[ids, np.arange(n_tok)[:, None]])
    else:
        groups = group_by_expert(ids, n_exp)
        y = rng.standard_normal((n_tok * top_k, D)).astype(np.float32)
        index = np.empty(n_tok * top_k, np.int32)
        index[groups.order] = np.arange(n_tok * top_k)
        delta = combine(y, groups, weights)
    d_y, d_index, d_w, d_norm = (cuda.to_device(a) for a in (y, index, weights, norm_w))
    h, out = cuda.to_device(hidden), nan_device((n_tok, D))
    launch_moe_combine_rmsnorm(d_y, d_index, d_w, h, d_norm, EPS, out, dense=dense, threads=threads)
    got_h, got_out = h.copy_to_host(), out.copy_to_host()
    assert_close(got_h, hidden + delta, 1e-5)
    assert_close(got_out, rms_norm(hidden + delta, norm_wf, EPS), 1e-5)
    # the unfused pair on the same inputs: the same bits (what lets the decoder switch between them)
    h2, out2 = cuda.to_device(hidden), nan_device((n_tok, D))
    if dense:
        launch_moe_combine_dense(d_y, d_index, d_w, h2)
    else:
        launch_moe_combine(d_y, d_index, d_w, h2)
    launch_rmsnorm(h2, d_norm, EPS, out2, threads=threads)
    np.testing.assert_array_equal(got_h, h2.copy_to_host())
    np.testing.assert_array_equal(got_out, out2.copy_to_host())


@pytest.mark.parametrize(
    "n_tok,top_k,n_exp,D,dtype,dense",
    [
        (1, 1, 3, 5, np.float32, False),
        (1, 1, 3, 5, np.uint16, True),
        (5, 2, 8, 37, np.float16, False),
        (5, 2, 8, 37, np.uint16, True),  # D not a multiple of the threads
        (3, 4, 7, 70, np.uint16, False),
        (3, 4, 7, 70, np.float32, True),
    ],
)
def test_moe_combine_rmsnorm_matches_reference(n_tok, top_k, n_exp, D, dtype, dense):
    _check(np.random.default_rng(n_tok * 100 + D), n_tok, top_k, n_exp, D, dtype, dense, threads=32)


def test_moe_combine_rmsnorm_rejects_aliasing_shapes():
    y = cuda.to_device(np.ones((4, 8), np.float32))
    with pytest.raises(AssertionError):  # position of the wrong length for T*K rows
        launch_moe_combine_rmsnorm(
            y,
            cuda.to_device(np.arange(3, dtype=np.int32)),
            cuda.to_device(np.ones((2, 2), np.float32)),
            cuda.to_device(np.ones((2, 8), np.float32)),
            cuda.to_device(np.ones(8, np.float32)),
            EPS,
            nan_device((2, 8)),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("n_tok", [1, 64, 2048])
def test_moe_combine_rmsnorm_gpu(dtype, dense, n_tok):
    rng = np.random.default_rng(n_tok)
    n_exp, top_k, D = (8, 2, 4096) if dense else (128, 8, 2048)
    if dense and n_tok > 64:  # the dense layout is the decode-size all-experts path
        n_tok = 64
    _check(rng, n_tok, top_k, n_exp, D, dtype, dense, threads=256)
