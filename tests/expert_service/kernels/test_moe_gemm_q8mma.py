"""Grouped MoE GEMM on tensor cores for 8-bit experts (moe_align -> moe_gather_bf16 -> q8mma gate_up -> q8mma
down -> moe_combine) vs the numpy references: moe_reference_q8 (the kernel's roundings) and expert_quant's exact
expert_ffn (what moe_q8 computes, within bf16 tolerance).

Simulator: tiny shapes on small tiles (the mma is emulated with the PTX fragment layout, so the 8-bit staging,
its swizzle, the widening and both scale schemes are exercised); GPU: the named configs at realistic sizes.
Layers mix int8 and fp8 experts with both scale schemes; output buffers start as NaN; ragged routing has
experts with no tokens and an expert with most of them; input dims that are not multiples of BK (K tails) and
of 128 (partial scale blocks)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import expert_quant as q
from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_gemm_q8mma import (
    CONFIGS,
    SIM_CONFIG,
    SIM_CONFIG_2,
    launch_q8mma_down,
    launch_q8mma_gate_up,
    moe_reference_q8,
)
from expert_service.kernels.numeric import SIMULATOR
from tests.helpers import random_ids

NAN16 = 0x7FC1
KINDS = [
    (q.CODE_INT8, q.SCALE_CHANNEL),
    (q.CODE_FP8, q.SCALE_BLOCK),
    (q.CODE_FP8, q.SCALE_CHANNEL),
    (q.CODE_INT8, q.SCALE_CHANNEL),
    (q.CODE_FP8, q.SCALE_BLOCK),
]


def block_gains(rows, cols):
    """[rows, cols] factors, distinct per 128x128 block (1, 5, 25, .. along a row of blocks, x 3 down a column):
    a kernel reading a neighbouring block's scale is off by 3x or more, far outside any rounding tolerance."""
    return 3.0 ** (np.arange(rows) // 128)[:, None] * 5.0 ** (np.arange(cols) // 128)[None, :]


def q8_layer(rng, kinds, F, D, gains=False):
    """uint8 [E, stride] blocks of random experts (4096-aligned stride, padding bytes 0xFF: fp8 NaN, so a stray
    read shows), meta [E, 8]; gains: each matrix times block_gains (block scales far apart)."""
    stride = -(-max(q.block_offsets(c, s, F, D)[6] for c, s in kinds) // 4096) * 4096
    blocks, metas = [], []
    for code, scheme in kinds:
        gate, up = (rng.standard_normal((F, D)).astype(np.float32) / np.sqrt(D) for _ in range(2))
        down = rng.standard_normal((D, F)).astype(np.float32) / np.sqrt(F)
        if gains:
            gate, up, down = (m * block_gains(*m.shape).astype(np.float32) for m in (gate, up, down))
        block, meta = q.pack_block(gate, up, down, code, scheme)
        padded = np.full(stride, 0xFF, np.uint8)
        padded[: block.size] = block
        blocks.append(padded)
        metas.append(meta)
    return np.stack(blocks), np.stack(metas)


def run(x, ids, route_w, W, meta, F, D, cfg, residual, launchers=None):
    """The layer on the device; launchers: (gate_up, down) with this module's signatures (None: q8mma's)."""
    gate_up, down = launchers or (launch_q8mma_gate_up, launch_q8mma_down)
    n_tok, top_k = ids.shape
    n_exp, n = W.shape[0], ids.size
    bm = cfg.block_m
    tiles = max_tiles(n, n_exp, bm)
    sorted_ids, tile_expert, num_tiles, position = (
        cuda.to_device(np.full(s, -7, np.int32)) for s in (tiles * bm, tiles, 1, n)
    )
    launch_moe_align(cuda.to_device(ids), n_exp, bm, sorted_ids, tile_expert, num_tiles, position)
    xs = cuda.to_device(np.full((tiles * bm, D), NAN16, np.uint16))
    launch_moe_gather_bf16(cuda.to_device(x), sorted_ids, num_tiles, top_k, bm, xs)
    h = cuda.to_device(np.full((tiles * bm, F), NAN16, np.uint16))
    dW, dmeta = cuda.to_device(W), cuda.to_device(meta)
    gate_up(xs, tile_expert, num_tiles, dW, dmeta, F, D, h, config=cfg)
    y = cuda.to_device(np.full((n, D), np.nan, np.float32))
    down(h, tile_expert, num_tiles, sorted_ids, dW, dmeta, F, D, y, config=cfg)
    out = cuda.to_device(residual.copy())
    launch_moe_combine(y, cuda.to_device(np.arange(n, dtype=np.int32)), cuda.to_device(route_w), out)
    h_all = (h.copy_to_host().astype(np.uint32) << 16).view(np.float32)
    used = int(num_tiles.copy_to_host()[0]) * bm
    return (
        h_all[position.copy_to_host()],
        h_all[:used],
        sorted_ids.copy_to_host()[:used],
        y.copy_to_host(),
        (out.copy_to_host()),
    )


def check(ids, kinds, F, D, cfg, seed, gains=False, launchers=None):
    rng = np.random.default_rng(seed)
    n_tok, top_k = ids.shape
    W, meta = q8_layer(rng, kinds, F, D, gains)
    x = rng.standard_normal((n_tok, D)).astype(np.float32)
    route_w = rng.random((n_tok, top_k)).astype(np.float32) + 0.1
    residual = rng.standard_normal((n_tok, D)).astype(np.float32)
    h, h_used, sorted_ids, y, out = run(x, ids, route_w, W, meta, F, D, cfg, residual, launchers)
    ref_h, ref_y, ref_out = moe_reference_q8(x, ids, route_w, W, meta, F, D, residual)
    assert np.isfinite(h_used).all(), "a used row of h was not written"
    assert (h_used[sorted_ids < 0] == 0).all(), "padding rows of h must be zeros"
    assert np.isfinite(y).all(), "a routed row of y was not written"
    # h: bf16 of an fp32 sum vs bf16 of the float64 sum (one bf16 step apart at most)
    np.testing.assert_allclose(h, ref_h, rtol=2**-7, atol=2**-7 * np.abs(ref_h).max())
    # y from the kernel's own h: fp32 accumulation is all that differs from the float64 reference
    _, y_own, _ = moe_reference_q8_from_h(h, ids, W, meta, F, D)
    np.testing.assert_allclose(y, y_own, rtol=1e-4, atol=1e-4 * np.abs(y_own).max())
    np.testing.assert_allclose(out, ref_out, rtol=2e-2, atol=1e-2 * np.abs(ref_out).max())
    # against the exact dequantised expert (moe_q8's arithmetic): within the bf16 rounding of x, h and weights
    exact = residual.astype(np.float64).copy()
    for t in range(n_tok):
        for k in range(top_k):
            e = ids[t, k]
            exact[t] += route_w[t, k] * q.expert_ffn(x[t : t + 1], W[e], meta[e], F, D)[0]
    np.testing.assert_allclose(out, exact, rtol=5e-2, atol=2e-2 * np.abs(exact).max())


def moe_reference_q8_from_h(h, ids, W, meta, F, D):
    """y [T*K, D] float64 of the kernel's own h rows through each expert's down matrix (the kernel's weights)."""
    from expert_service.kernels.moe_gemm_q8mma import kernel_weights

    y = np.zeros((ids.size, D))
    for e in np.unique(ids):
        (_, _, down), scales = kernel_weights(W[e], meta[e], F, D)
        rows = np.flatnonzero(ids.reshape(-1) == e)
        y[rows] = h[rows].astype(np.float64) @ down.astype(np.float64).T
        if scales is not None:
            y[rows] *= scales[2]
    return None, y, None


@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes (the GPU tests cover real configs)")
def test_sim_mixed_layer_k_tail_and_scale_blocks():
    # D = 144: gate/up inputs span two 128-wide scale blocks (the second partial) and end mid-step (BK = 32);
    # down has 144 rows (two scale-block rows). Expert 4 gets no token.
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 6, 2, 4)
    check(ids, KINDS, 32, 144, SIM_CONFIG, seed=2)


@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes")
def test_sim_two_warps_along_m_bk64():
    # BM = 32 over two warps, BK = 64 (another swizzle of both tiles), F = 48: gate|up n tail
    ids = np.array([[0, 2], [2, 1], [2, 0], [2, 3], [1, 2], [2, 0], [3, 2], [0, 1], [2, 1]], np.int32)
    check(ids, KINDS[:4], 48, 64, SIM_CONFIG_2, seed=3)


@pytest.mark.slow  # about half a minute in the simulator: started first
@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes")
def test_sim_block_scales_across_bk64_steps():
    # BK = 64 (as the m64 / m128 configs): two main-loop steps per 128-wide scale block, then a partial block
    # ending mid-step (gate|up: D = 208 = 128 + 64 + 16; down: F = 144 = 128 + 16); output rows cross a
    # scale-block row too (F = 144 gate/up rows, D = 208 down rows). Each 128x128 block has its own gain, so
    # a step, n-tile or tail reading another block's scale is off by 3x or more.
    ids = np.array([[0, 1], [1, 2], [2, 0], [1, 0], [2, 1], [0, 2], [1, 2]], np.int32)
    kinds = [(q.CODE_FP8, q.SCALE_BLOCK), (q.CODE_FP8, q.SCALE_BLOCK), (q.CODE_INT8, q.SCALE_CHANNEL)]
    check(ids, kinds, 144, 208, SIM_CONFIG_2, seed=4, gains=True)


def test_rejects_bad_shapes():
    W = cuda.to_device(np.zeros((2, 4096), np.uint8))
    meta = cuda.to_device(np.zeros((2, q.META_WIDTH), np.int32))
    one = cuda.to_device(np.zeros(1, np.int32))
    cfg = SIM_CONFIG
    xs = cuda.to_device(np.zeros((cfg.block_m, 24), np.uint16))
    h = cuda.to_device(np.zeros((cfg.block_m, 16), np.uint16))
    with pytest.raises(ValueError, match="multiples of 16"):
        launch_q8mma_gate_up(xs, one, one, W, meta, 16, 24, h, config=cfg)
    with pytest.raises(ValueError, match="experts must be uint8"):
        launch_q8mma_gate_up(xs, one, one, cuda.to_device(np.zeros((2, 2048), np.uint16)), meta, 16, 24, h, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    "n_tok,top_k,n_exp,F,D",
    [
        (300, 2, 8, 384, 512),  # mixtral-like ratios
        (200, 8, 40, 96, 256),  # many experts, few rows each
        (45, 3, 5, 272, 208),  # K tails, partial scale blocks on both matrices
    ],
)
def test_gpu_configs(name, n_tok, top_k, n_exp, F, D):
    rng = np.random.default_rng(n_tok + F)
    kinds = [KINDS[e % len(KINDS)] for e in range(n_exp)]
    check(random_ids(rng, n_tok, top_k, n_exp), kinds, F, D, CONFIGS[name], seed=n_tok)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_skewed_routing(name):
    n_tok = 257
    ids = np.stack([np.zeros(n_tok, np.int32), 2 + np.arange(n_tok, dtype=np.int32) % 4], axis=1)
    check(ids, [KINDS[e % len(KINDS)] for e in range(16)], 144, 272, CONFIGS[name], seed=7)
