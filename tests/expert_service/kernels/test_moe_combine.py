"""moe_combine vs expert_service.experts.grouping.combine (+ residual), and the whole device MoE pipeline
launch_gate_topk -> launch_expert_grouping -> launch_moe_gate_up -> launch_moe_down -> launch_moe_combine vs layers.moe.sparse_moe."""

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.moe import sparse_moe
from expert_service.experts.grouping import combine, group_by_expert
from expert_service.kernels.expert_grouping import launch_expert_grouping
from expert_service.kernels.gate_topk import launch_gate_topk
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_ffn import launch_moe_down, launch_moe_gate_up
from tests.helpers import expert_buffer, random_ids


@pytest.mark.parametrize("n_tok,top_k,n_exp,D", [(1, 1, 3, 5), (33, 2, 8, 37), (6, 4, 7, 64)])
def test_combine_matches_reference(n_tok, top_k, n_exp, D):
    rng = np.random.default_rng(n_tok + D)
    groups = group_by_expert(random_ids(rng, n_tok, top_k, n_exp), n_exp)
    y = rng.standard_normal((n_tok * top_k, D)).astype(np.float32)
    weights = rng.random((n_tok, top_k)).astype(np.float32)
    hidden = rng.standard_normal((n_tok, D)).astype(np.float32)
    position = np.empty(n_tok * top_k, np.int32)
    position[groups.order] = np.arange(n_tok * top_k)
    out = cuda.to_device(hidden)
    launch_moe_combine(cuda.to_device(y), cuda.to_device(position), cuda.to_device(weights), out)
    np.testing.assert_allclose(out.copy_to_host(), hidden + combine(y, groups, weights), rtol=1e-5, atol=1e-6)


def test_combine_spread_over_blocks_gives_the_same_bits(monkeypatch):
    """A decode token's row spread over several blocks sums each element as one block per token does."""
    import expert_service.kernels.moe_combine as module
    import expert_service.kernels.numeric as numeric

    rng = np.random.default_rng()
    n_tok, top_k, D = 2, 8, 200
    assert numeric.blocks_per_row(n_tok, D, module.THREADS) > 1
    y = cuda.to_device(rng.standard_normal((n_tok * top_k, D)).astype(np.float32))
    position = cuda.to_device(rng.permutation(n_tok * top_k).astype(np.int32))
    weights = cuda.to_device(rng.random((n_tok, top_k)).astype(np.float32))
    hidden = rng.standard_normal((n_tok, D)).astype(np.float32)
    spread, single = cuda.to_device(hidden), cuda.to_device(hidden)
    launch_moe_combine(y, position, weights, spread)
    monkeypatch.setattr(numeric, "SPREAD_TARGET_BLOCKS", 1)
    launch_moe_combine(y, position, weights, single)
    got = spread.copy_to_host()
    assert not np.array_equal(got, hidden) and np.array_equal(got, single.copy_to_host())


def _norm_case(rng, n_tok, top_k, D, norm_dtype):
    """Device (y, position, weights, norm weight [D] in norm_dtype, bf16 as its bits) and the host residual."""
    y = cuda.to_device(rng.standard_normal((n_tok * top_k, D)).astype(np.float32))
    position = cuda.to_device(rng.permutation(n_tok * top_k).astype(np.int32))
    weights = cuda.to_device(rng.random((n_tok, top_k)).astype(np.float32))
    norm = (rng.standard_normal(D) + 1).astype(np.float32)
    norm = (norm.view(np.uint32) >> 16).astype(np.uint16) if norm_dtype == np.uint16 else norm.astype(norm_dtype)
    return y, position, weights, cuda.to_device(norm), rng.standard_normal((n_tok, D)).astype(np.float32)


def _combine_then_norm(y, position, weights, norm_weight, hidden):
    """(h, out) of moe_combine, then rmsnorm as the decoder launches it (its own thread count)."""
    from expert_service.kernels.rmsnorm import launch_rmsnorm

    h = cuda.to_device(hidden)
    out = cuda.to_device(np.full(hidden.shape, np.nan, np.float32))
    launch_moe_combine(y, position, weights, h)
    launch_rmsnorm(h, norm_weight, 1e-6, out)
    return h.copy_to_host(), out.copy_to_host()


@pytest.mark.parametrize(
    "n_tok,top_k,D,norm_dtype", [(1, 8, 200, np.uint16), (3, 2, 130, np.float32), (5, 4, 64, np.float16)]
)
def test_combine_with_the_next_norm_gives_combine_then_rmsnorm_bits(n_tok, top_k, D, norm_dtype):
    """The last of a token's blocks normalises the row: h and out equal moe_combine then rmsnorm bit for bit, the
    tickets are zero again after every launch (a graph replays it), and a second launch normalises its own row."""
    rng = np.random.default_rng(n_tok * 100 + D)
    y, position, weights, norm_weight, hidden = _norm_case(rng, n_tok, top_k, D, norm_dtype)
    tickets = cuda.to_device(np.zeros(n_tok + 2, np.int32))
    h = cuda.to_device(hidden)
    row = hidden
    for launch in range(2):
        want_h, want_x = _combine_then_norm(y, position, weights, norm_weight, row)
        out = cuda.to_device(np.full((n_tok, D), np.nan, np.float32))
        launch_moe_combine(y, position, weights, h, norm=(norm_weight, 1e-6, out, tickets))
        row = h.copy_to_host()
        assert np.array_equal(row, want_h) and np.array_equal(out.copy_to_host(), want_x), f"launch {launch}"
        assert not tickets.copy_to_host().any()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [2048, 4096])
def test_combine_with_the_next_norm_over_many_blocks_on_the_gpu(D):
    """Real blocks finishing in any order (2 to 16 blocks a token): every relaunch gives combine + rmsnorm's bits,
    every element of out written, the tickets zero after each."""
    from expert_service.kernels import numeric
    from expert_service.kernels.rmsnorm import block_threads

    for n_tok in (1, 16, 64, 255):
        assert numeric.blocks_per_row(n_tok, D, block_threads(D)) > 1, (n_tok, D)
        rng = np.random.default_rng(n_tok + D)
        y, position, weights, norm_weight, hidden = _norm_case(rng, n_tok, 8, D, np.uint16)
        want_h, want_x = _combine_then_norm(y, position, weights, norm_weight, hidden)
        tickets = cuda.to_device(np.zeros(n_tok, np.int32))
        for launch in range(40):
            h = cuda.to_device(hidden)
            out = cuda.to_device(np.full((n_tok, D), np.nan, np.float32))
            launch_moe_combine(y, position, weights, h, norm=(norm_weight, 1e-6, out, tickets))
            assert np.array_equal(h.copy_to_host(), want_h), (n_tok, launch)
            assert np.array_equal(out.copy_to_host(), want_x), (n_tok, launch)
            assert not tickets.copy_to_host().any(), (n_tok, launch)


def test_combine_with_the_next_norm_refuses_bad_arguments():
    rng = np.random.default_rng(3)
    y = cuda.to_device(rng.standard_normal((4, 64)).astype(np.float32))
    position = cuda.to_device(np.arange(4, dtype=np.int32))
    weights = cuda.to_device(rng.random((2, 2)).astype(np.float32))
    h, out = cuda.to_device(np.zeros((2, 64), np.float32)), cuda.to_device(np.zeros((2, 64), np.float32))
    norm_weight = cuda.to_device(np.ones(64, np.float32))
    with pytest.raises(ValueError, match=r"^tickets must be C-contiguous int32 \[2\], got int32 \[1\]$"):
        launch_moe_combine(
            y, position, weights, h, norm=(norm_weight, 1e-6, out, cuda.to_device(np.zeros(1, np.int32)))
        )
    with pytest.raises(ValueError, match=r"^norm_weight must be C-contiguous float32 \[64\], got float32 \[32\]$"):
        short = cuda.to_device(np.ones(32, np.float32))
        launch_moe_combine(y, position, weights, h, norm=(short, 1e-6, out, cuda.to_device(np.zeros(2, np.int32))))


def run_pipeline(x, router, top_k, normalize, W, F, D):
    """Device MoE layer on x [T, D]; router logits come from the host (the gate GEMM is another kernel)."""
    n_tok, n_exp = x.shape[0], router.shape[0]
    n = n_tok * top_k
    ids = cuda.to_device(np.full((n_tok, top_k), -1, np.int32))
    weights = cuda.to_device(np.full((n_tok, top_k), np.nan, np.float32))
    counts, offsets, order, position = (cuda.to_device(np.full(s, -1, np.int32)) for s in (n_exp, n_exp + 1, n, n))
    h = cuda.to_device(np.full((n, F), np.nan, np.float32))
    y = cuda.to_device(np.full((n, D), np.nan, np.float32))
    out = cuda.to_device(np.zeros((n_tok, D), np.float32))  # residual stream (zero: compare the MoE output)
    dx, dW = cuda.to_device(x), cuda.to_device(W)
    launch_gate_topk(cuda.to_device(x @ router.T), ids, weights, normalize)
    launch_expert_grouping(ids, counts, offsets, order, position)
    launch_moe_gate_up(dx, order, offsets, dW, F, D, h)
    launch_moe_down(h, order, offsets, dW, F, D, y)
    launch_moe_combine(y, position, weights, out)
    return out.copy_to_host(), ids.copy_to_host()


@pytest.mark.parametrize(
    "dtype,n_tok,top_k,n_exp,normalize", [(np.uint16, 5, 2, 7, True), (np.float32, 3, 3, 4, False)]
)
def test_pipeline_matches_sparse_moe(dtype, n_tok, top_k, n_exp, normalize):
    rng = np.random.default_rng(11)
    F, D = 12, 20
    W, mats = expert_buffer(rng, n_exp, F, D, dtype)
    x = rng.standard_normal((n_tok, D)).astype(np.float32)
    router = rng.standard_normal((n_exp, D)).astype(np.float32)
    out, ids = run_pipeline(x, router, top_k, normalize, W, F, D)
    ref, ref_ids = sparse_moe(x, router, top_k, normalize, lambda e: mats[e])
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("n_exp,top_k,F,D", [(8, 2, 14336, 4096), (128, 8, 768, 2048)])
@pytest.mark.parametrize("n_tok", [1, 16, 64, 512])
def test_gpu_pipeline_realistic(n_tok, n_exp, top_k, F, D):
    rng = np.random.default_rng(n_tok)
    W, mats = expert_buffer(rng, n_exp, F, D, np.uint16, scale=0.02)
    x = rng.standard_normal((n_tok, D)).astype(np.float32)
    router = (rng.standard_normal((n_exp, D)) * 0.05).astype(np.float32)
    out, ids = run_pipeline(x, router, top_k, True, W, F, D)
    ref, ref_ids = sparse_moe(x, router, top_k, True, lambda e: mats[e])
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
