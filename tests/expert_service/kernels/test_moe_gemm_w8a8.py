"""The W8A8 grouped MoE GEMM (8-bit weights x 8-bit activation rows on warpgroup MMA) against its numpy reference,
GPU only (wgmma has no simulator). Each layer is one kind (int8 per channel, fp8 per channel, fp8 128x128 blocks,
the block grids with gains 3-25x apart so a neighbouring block's scale is far outside tolerance); inputs are
quantized by quantize_rows (itself tested bitwise against common.quant); outputs start as NaN; ragged and skewed
routing; several M tiles an expert; D not a multiple of the 256-wide N tile. Checks: h against the float64 SwiGLU
of the dequantised 8-bit rows and weights (one bf16 step), y from the kernel's own quantized h (fp32 accumulation
only), the combined output against the exact bf16-activation expert (the activation rounding's size), and an
expert of another kind giving NaN rows. The refusals run anywhere."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import expert_quant as q
from expert_service.kernels.moe_align import launch_moe_align, max_tiles
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_gemm_w8a8 import config_for, launch_w8a8_down, launch_w8a8_gate_up, moe_reference_w8a8
from expert_service.kernels.moe_gemm_wgmma import CONFIGS
from expert_service.kernels.quantize_rows import (
    launch_quantize_gathered,
    launch_quantize_rows,
    quantize_rows_reference,
    w8a8_swiglu_reference,
)
from tests.expert_service.kernels.test_moe_gemm_q8mma import q8_layer
from tests.helpers import random_ids

KINDS = {
    "int8": (q.CODE_INT8, q.SCALE_CHANNEL),
    "fp8": (q.CODE_FP8, q.SCALE_CHANNEL),
    "fp8_block": (q.CODE_FP8, q.SCALE_BLOCK),
    "int8_narrow": (q.CODE_INT8, q.SCALE_CHANNEL),  # per channel on the 64-row tile (steps of few rows an expert)
    "fp8_narrow": (q.CODE_FP8, q.SCALE_CHANNEL),
}


def run(x, ids, route_w, W, meta, F, D, code, block_scaled, residual, cfg=None):
    n_tok, top_k = ids.shape
    n_exp, n = W.shape[0], ids.size
    cfg = cfg or config_for(block_scaled)
    bm = cfg.block_m
    tiles = max_tiles(n, n_exp, bm)
    rows = tiles * bm
    sorted_ids, tile_expert, num_tiles, position = (
        cuda.to_device(np.full(s, -7, np.int32)) for s in (rows, tiles, 1, n)
    )
    launch_moe_align(cuda.to_device(ids), n_exp, bm, sorted_ids, tile_expert, num_tiles, position)
    xq = cuda.to_device(np.full((rows, D), 0xAB, np.uint8))
    x_scale = cuda.to_device(np.full(rows, np.nan, np.float32))
    launch_quantize_gathered(cuda.to_device(x), sorted_ids, num_tiles, top_k, bm, code, xq, x_scale)
    dW, dmeta = cuda.to_device(W), cuda.to_device(meta)
    h = cuda.to_device(np.full((rows, F), 0x7FC0, np.uint16))  # bf16 NaN
    launch_w8a8_gate_up(xq, x_scale, tile_expert, num_tiles, dW, dmeta, code, block_scaled, F, D, h, cfg)
    hq = cuda.to_device(np.full((rows, F), 0xAB, np.uint8))
    h_scale = cuda.to_device(np.full(rows, np.nan, np.float32))
    launch_quantize_rows(h, num_tiles, bm, code, hq, h_scale)
    y = cuda.to_device(np.full((n, D), np.nan, np.float32))
    launch_w8a8_down(hq, h_scale, tile_expert, num_tiles, sorted_ids, dW, dmeta, code, block_scaled, F, D, y, cfg)
    out = cuda.to_device(residual.copy())
    launch_moe_combine(y, cuda.to_device(np.arange(n, dtype=np.int32)), cuda.to_device(route_w), out)
    used = int(num_tiles.copy_to_host()[0]) * bm
    h_all = (h.copy_to_host().astype(np.uint32) << 16).view(np.float32)
    return dict(
        order=sorted_ids.copy_to_host()[:used],
        xq=xq.copy_to_host()[:used],
        x_scale=x_scale.copy_to_host()[:used],
        h=h_all[:used],
        hq=hq.copy_to_host()[:used],
        h_scale=h_scale.copy_to_host()[:used],
        y=y.copy_to_host(),
        out=out.copy_to_host(),
    )


def check(ids, kind, F, D, seed, gains=False):
    code, scheme = KINDS[kind]
    rng = np.random.default_rng(seed)
    n_tok, top_k = ids.shape
    W, meta = q8_layer(rng, [(code, scheme)] * (int(ids.max()) + 1), F, D, gains)
    x = rng.standard_normal((n_tok, D)).astype(np.float32)
    route_w = rng.random((n_tok, top_k)).astype(np.float32) + 0.1
    residual = rng.standard_normal((n_tok, D)).astype(np.float32)
    narrow = kind.endswith("_narrow")
    got = run(
        x, ids, route_w, W, meta, F, D, code, scheme == q.SCALE_BLOCK, residual, CONFIGS["w64"] if narrow else None
    )
    order, routed = got["order"], got["order"] >= 0
    assert (got["h"][~routed] == 0).all(), "padding rows of h must be zeros"
    assert np.isfinite(got["h"][routed]).all() and np.isfinite(got["y"]).all(), "a routed row was not written"
    y_ref = np.zeros((ids.size, D))
    for e in np.unique(ids):
        rows = np.flatnonzero(routed & (np.where(routed, ids.reshape(-1)[np.maximum(order, 0)], -1) == e))
        h_ref, y_own = moe_reference_w8a8(
            got["xq"][rows], got["x_scale"][rows], W[e], meta[e], F, D, code, got["hq"][rows], got["h_scale"][rows]
        )
        # h: bf16 of an fp32 sum against bf16 of the float64 sum (one bf16 step apart at most)
        np.testing.assert_allclose(got["h"][rows], h_ref, rtol=2**-7, atol=2**-7 * np.abs(h_ref).max())
        y_ref[order[rows]] = y_own
    # y from the kernel's own quantized h: int8 sums are exact (int32); fp8 ones run ~14-bit within each 128-feature
    # step, fp32 across steps, with block scales (H200: one element in 131,584 at 1.4e-3 on skewed routing), ~14-bit
    # throughout per channel (4.5e-3 at K = 14,336); a wrong block's scale is off by 3-25x
    y_tol = 1e-4 if code == q.CODE_INT8 else 2e-3 if scheme == q.SCALE_BLOCK else 5e-3
    np.testing.assert_allclose(got["y"], y_ref, rtol=y_tol, atol=y_tol * np.abs(y_ref).max())
    # the quantized rows are quantize_rows' (tested bitwise elsewhere): the x rows of this step
    ref_q, ref_s = quantize_rows_reference(x[order[routed] // top_k], code)
    np.testing.assert_array_equal(got["xq"][routed], ref_q)
    # against the exact expert on float32 x (moe_q8's arithmetic): within the 8-bit activations' rounding
    exact = residual.astype(np.float64).copy()
    for t in range(n_tok):
        for k in range(top_k):
            e = ids[t, k]
            exact[t] += route_w[t, k] * q.expert_ffn(x[t : t + 1], W[e], meta[e], F, D)[0]
    tol = 0.1 if code == q.CODE_FP8 else 0.05  # e4m3 keeps 3 mantissa bits, int8 7 of a row's max (numpy: 3-5 %)
    np.testing.assert_allclose(got["out"], exact, rtol=tol, atol=tol * np.abs(exact).max())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    "n_tok,top_k,n_exp,F,D",
    [
        (300, 2, 8, 384, 512),  # mixtral-like ratios
        (200, 8, 40, 128, 256),  # many experts, few rows each
        (700, 2, 8, 256, 1024),  # several M tiles an expert
        (45, 3, 5, 256, 384),  # D not a multiple of the 256-wide N tile; few rows
        (40, 2, 4, 128, 128),  # one K step each (fewer steps than primed stages)
    ],
)
def test_gpu_kinds(kind, n_tok, top_k, n_exp, F, D):
    rng = np.random.default_rng(n_tok + F)
    check(random_ids(rng, n_tok, top_k, n_exp), kind, F, D, seed=n_tok)


@pytest.mark.gpu
def test_gpu_block_scales_far_apart():
    ids = np.array([[0, 1], [1, 2], [2, 0], [1, 0], [2, 1], [0, 2], [1, 2]] * 20, np.int32)
    check(ids, "fp8_block", 256, 384, seed=4, gains=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_skewed_routing(kind):
    n_tok = 257
    ids = np.stack([np.zeros(n_tok, np.int32), 2 + np.arange(n_tok, dtype=np.int32) % 4], axis=1)
    check(ids, kind, 128, 256, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
def test_gpu_an_expert_of_another_kind_gives_nan_rows(code):
    """Each kernel checks the kind itself: gate|up on the layer, and down alone on finite 8-bit rows (so a NaN h
    from gate|up cannot stand in for down's own check)."""
    rng = np.random.default_rng(5)
    F, D = 128, 256
    other = q.CODE_FP8 if code == q.CODE_INT8 else q.CODE_INT8
    W, meta = q8_layer(rng, [(code, q.SCALE_CHANNEL), (other, q.SCALE_CHANNEL)], F, D)
    ids = np.array([[0, 1]] * 64, np.int32)
    got = run(
        rng.standard_normal((64, D)).astype(np.float32),
        ids,
        np.ones((64, 2), np.float32),
        W,
        meta,
        F,
        D,
        code,
        False,
        np.zeros((64, D), np.float32),
    )
    y = got["y"].reshape(64, 2, D)
    assert np.isfinite(y[:, 0]).all() and np.isnan(y[:, 1]).all()
    cfg = config_for(False)
    tiles = max_tiles(ids.size, 2, cfg.block_m)
    rows = tiles * cfg.block_m
    sorted_ids, tile_expert, num_tiles, position = (
        cuda.to_device(np.full(s, -7, np.int32)) for s in (rows, tiles, 1, ids.size)
    )
    launch_moe_align(cuda.to_device(ids), 2, cfg.block_m, sorted_ids, tile_expert, num_tiles, position)
    hq = cuda.to_device(rng.integers(0, 100, (rows, F)).astype(np.uint8))  # finite codes in both types
    h_scale = cuda.to_device(np.full(rows, 0.01, np.float32))
    y_down = cuda.to_device(np.full((ids.size, D), 7.0, np.float32))
    launch_w8a8_down(
        hq,
        h_scale,
        tile_expert,
        num_tiles,
        sorted_ids,
        cuda.to_device(W),
        cuda.to_device(meta),
        code,
        False,
        F,
        D,
        y_down,
        cfg,
    )
    y2 = y_down.copy_to_host().reshape(64, 2, D)
    assert np.isfinite(y2[:, 0]).all() and np.isnan(y2[:, 1]).all()


def test_rejects_dims_that_are_not_whole_steps():
    W = cuda.to_device(np.zeros((2, 4096), np.uint8))
    meta = cuda.to_device(np.zeros((2, q.META_WIDTH), np.int32))
    one = cuda.to_device(np.zeros(1, np.int32))
    cfg = config_for(False)
    xq = cuda.to_device(np.zeros((cfg.block_m, 192), np.uint8))
    scales = cuda.to_device(np.ones(cfg.block_m, np.float32))
    h = cuda.to_device(np.zeros((cfg.block_m, 128), np.uint16))
    with pytest.raises(ValueError, match="multiples of 128"):
        launch_w8a8_gate_up(xq, scales, one, one, W, meta, q.CODE_INT8, False, 128, 192, h, cfg)
    with pytest.raises(ValueError, match="block scales run on"):
        launch_w8a8_gate_up(xq, scales, one, one, W, meta, q.CODE_FP8, True, 128, 192, h, cfg)  # block: 64 rows


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_kernel_reference_is_the_cpu_emulation(kind):
    """moe_reference_w8a8 (what the GPU tests hold the kernels to) and w8a8_swiglu_reference (what the cpu backend
    runs when W8A8 is emulated: bench/quant_quality.py, the engine tests) compute the same expert, float64 against
    float32 products."""
    code, scheme = KINDS[kind]
    rng = np.random.default_rng(21)
    F, D = 256, 384
    W, meta = q8_layer(rng, [(code, scheme)], F, D)
    x = rng.standard_normal((40, D)).astype(np.float32)
    xq, xs = quantize_rows_reference(x, code)
    h, _ = moe_reference_w8a8(xq, xs, W[0], meta[0], F, D, code)
    hq, hs = quantize_rows_reference(h, code)
    _, y = moe_reference_w8a8(xq, xs, W[0], meta[0], F, D, code, hq, hs)
    gate, up, down = q.dequantize(W[0], meta[0], F, D)
    emulated = w8a8_swiglu_reference(x, gate, up, down, code)
    np.testing.assert_allclose(emulated, y, rtol=1e-3, atol=1e-4 * np.abs(y).max())
