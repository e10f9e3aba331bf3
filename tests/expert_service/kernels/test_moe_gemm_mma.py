"""Grouped MoE GEMM on tensor cores (moe_align -> moe_gather_bf16 -> moe_gemm_gate_up -> moe_gemm_down with
either combine) vs the numpy reference moe_reference (same bf16 roundings of x and h, float64 products).

Simulator: tiny shapes on small tiles (the mma is emulated with the PTX fragment layout, so the swizzled
staging, the k permutation, the grid order and the epilogues are all exercised); GPU: the named configs at
awkward and realistic sizes. Every output buffer starts as NaN; ragged routing includes experts with no
tokens and an expert with all of them.
Tolerances: h is bf16 of an fp32 sum vs bf16 of the float64 sum (one bf16 step where they round apart);
y and the combined output are checked against float64 products of the kernel's own h (fp32 accumulation
only), and end to end against the reference's h."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_gemm_mma import (
    CONFIGS,
    SIM_CONFIG,
    SIM_CONFIG_2,
    launch_moe_gemm_down,
    launch_moe_gemm_gate_up,
    moe_reference,
)
from expert_service.kernels.numeric import SIMULATOR
from tests.helpers import expert_buffer, random_ids

NAN16 = 0x7FC1


def _bf16(words):
    return (words.astype(np.uint32) << 16).view(np.float32)


def run_moe(x, ids, route_w, W, F, D, cfg, combine, residual, launchers=None):
    """The whole per-layer sequence on the device; returns (h rows by assignment, y or None, out, sorted_ids,
    num_tiles). launchers: (gate_up, down) with moe_gemm_mma's signatures (None: moe_gemm_mma's own)."""
    gate_up, down = launchers or (launch_moe_gemm_gate_up, launch_moe_gemm_down)
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
    dW = cuda.to_device(W)
    gate_up(xs, tile_expert, num_tiles, dW, F, D, h, config=cfg)
    out = cuda.to_device(residual.copy())
    d_w = cuda.to_device(route_w)
    y = None
    if combine == "atomic":
        down(h, tile_expert, num_tiles, sorted_ids, dW, F, D, out, route_weights=d_w, combine="atomic", config=cfg)
    else:
        d_y = cuda.to_device(np.full((n, D), np.nan, np.float32))
        down(h, tile_expert, num_tiles, sorted_ids, dW, F, D, d_y, combine="store", config=cfg)
        launch_moe_combine(d_y, cuda.to_device(np.arange(n, dtype=np.int32)), d_w, out)
        y = d_y.copy_to_host()
    pos = position.copy_to_host()
    h_all = _bf16(h.copy_to_host())
    used = int(num_tiles.copy_to_host()[0]) * bm
    return h_all[pos], h_all[:used], sorted_ids.copy_to_host()[:used], y, out.copy_to_host()


def check(ids, n_exp, F, D, cfg, combine, seed, route_w=None, launchers=None):
    rng = np.random.default_rng(seed)
    n_tok, top_k = ids.shape
    W, mats = expert_buffer(rng, n_exp, F, D, np.uint16, scale=1.0 / np.sqrt(D))
    x = rng.standard_normal((n_tok, D)).astype(np.float32)
    if route_w is None:
        route_w = rng.random((n_tok, top_k)).astype(np.float32)
    residual = rng.standard_normal((n_tok, D)).astype(np.float32)
    h, h_used, sorted_ids, y, out = run_moe(x, ids, route_w, W, F, D, cfg, combine, residual, launchers)
    ref_h, ref_y, ref_out = moe_reference(x, ids, route_w, mats, residual)
    assert np.isfinite(h_used).all(), "a used row of h was not written"
    assert (h_used[sorted_ids < 0] == 0).all(), "padding rows of h must be zeros"
    np.testing.assert_allclose(h, ref_h, rtol=2**-7, atol=2**-7 * np.abs(ref_h).max())
    # y / out from the kernel's own h: fp32 accumulation is all that differs
    y64 = np.zeros((ids.size, D))
    for e in np.unique(ids):
        rows = np.flatnonzero(ids.reshape(-1) == e)
        y64[rows] = h[rows].astype(np.float64) @ mats[int(e)][2].T.astype(np.float64)
    if y is not None:
        assert np.isfinite(y).all(), "a routed row of y was not written"
        np.testing.assert_allclose(y, y64, rtol=1e-4, atol=1e-4 * np.abs(y64).max())
    want = residual + (y64.reshape(n_tok, top_k, D) * route_w[:, :, None]).sum(axis=1)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(out, ref_out, rtol=2e-2, atol=1e-2 * np.abs(ref_out).max())


SIM_CASES = [SIM_CONFIG, SIM_CONFIG_2]


@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes (the GPU tests cover real configs)")
@pytest.mark.parametrize("combine", ["atomic", "store"])
@pytest.mark.parametrize("cfg", SIM_CASES, ids=["sim1", "sim2"])
def test_sim_aligned_ragged(cfg, combine):
    # 7 tokens x K=2 over 5 experts (some empty), D=40, F=24: multiples of 8 (16-byte loads), k and n tails
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 7, 2, 5)
    ids[:, 0] = np.where(ids[:, 0] == 4, 0, ids[:, 0])
    ids[:, 1] = np.where(ids[:, 1] == 4, 1, ids[:, 1])  # expert 4 gets no token
    check(ids, 5, 24, 40, cfg, combine, seed=2)


@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes")
@pytest.mark.parametrize("combine", ["atomic", "store"])
def test_sim_generic_odd_sizes(combine):
    # D=37, F=19: element loads, odd tails in k and in the output columns
    rng = np.random.default_rng(3)
    check(random_ids(rng, 6, 2, 4), 4, 19, 37, SIM_CONFIG, combine, seed=4)


@pytest.mark.skipif(not SIMULATOR, reason="simulator shapes")
def test_sim_all_tokens_on_one_expert():
    check(
        np.full((20, 1), 2, np.int32), 3, 16, 24, SIM_CONFIG_2, "atomic", seed=5, route_w=np.ones((20, 1), np.float32)
    )


def test_rejects_non_bf16_weights():
    cfg = SIM_CONFIG
    with pytest.raises(ValueError):
        launch_moe_gemm_gate_up(
            cuda.to_device(np.zeros((16, 8), np.uint16)),
            cuda.to_device(np.zeros(1, np.int32)),
            cuda.to_device(np.zeros(1, np.int32)),
            cuda.to_device(np.zeros((1, 200), np.float32)),
            8,
            8,
            cuda.to_device(np.zeros((16, 8), np.uint16)),
            config=cfg,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["atomic", "store"])
@pytest.mark.parametrize(
    "name,n_tok,top_k,n_exp,F,D",
    [
        *[(name, 300, 2, 8, 384, 512) for name in CONFIGS],  # aligned (16-byte loads), k / n tails
        *[(name, 200, 8, 128, 96, 256) for name in CONFIGS],  # 128 experts, ~12 rows each
        ("m16", 37, 3, 6, 100, 72),
        ("m64", 37, 3, 6, 100, 72),  # F % 8 != 0: element loads
        ("m16", 45, 2, 5, 61, 83),
        ("m64", 45, 2, 5, 61, 83),  # odd D and F
    ],
)
def test_gpu_configs(name, combine, n_tok, top_k, n_exp, F, D):
    rng = np.random.default_rng(n_tok + F)
    check(random_ids(rng, n_tok, top_k, n_exp), n_exp, F, D, CONFIGS[name], combine, seed=n_tok)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_skewed_routing(name):
    """An expert with every token (slot 0), experts with none (slot 1 only over experts 2..5 of 16)."""
    n_tok = 257
    ids = np.stack([np.zeros(n_tok, np.int32), 2 + np.arange(n_tok, dtype=np.int32) % 4], axis=1)
    check(ids, 16, 136, 264, CONFIGS[name], "atomic", seed=7)
