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


@pytest.mark.parametrize(
    "n_tok,top_k,D,norm_dtype", [(1, 8, 200, np.uint16), (3, 2, 130, np.float32), (5, 4, 64, np.float16)]
)
def test_combine_with_the_next_norm_gives_combine_then_rmsnorm_bits(n_tok, top_k, D, norm_dtype):
    """The last of a token's blocks normalises the row: h and out equal moe_combine then rmsnorm (the same thread
    count) bit for bit, the tickets are zero again after every launch (a graph replays it), a second launch too."""
    import expert_service.kernels.moe_combine as module
    from expert_service.kernels import numeric
    from expert_service.kernels.rmsnorm import launch_rmsnorm

    rng = np.random.default_rng()
    y = cuda.to_device(rng.standard_normal((n_tok * top_k, D)).astype(np.float32))
    position = cuda.to_device(rng.permutation(n_tok * top_k).astype(np.int32))
    weights = cuda.to_device(rng.random((n_tok, top_k)).astype(np.float32))
    norm_weight = (rng.standard_normal(D) + 1).astype(np.float32)
    if norm_dtype == np.uint16:
        norm_weight = (norm_weight.view(np.uint32) >> 16).astype(np.uint16)
    norm_weight = cuda.to_device(norm_weight.astype(norm_dtype) if norm_dtype != np.uint16 else norm_weight)
    hidden = rng.standard_normal((n_tok, D)).astype(np.float32)
    tickets = cuda.to_device(np.zeros(n_tok + 2, np.int32))
    assert numeric.blocks_per_row(n_tok, D, module.THREADS) > 1 or D <= module.THREADS
    want_h, want_x = cuda.to_device(hidden), cuda.to_device(np.full((n_tok, D), np.nan, np.float32))
    launch_moe_combine(y, position, weights, want_h)
    launch_rmsnorm(want_h, norm_weight, 1e-6, want_x, threads=module.THREADS)
    h = cuda.to_device(hidden)
    for launch in range(2):
        out = cuda.to_device(np.full((n_tok, D), np.nan, np.float32))
        launch_moe_combine(y, position, weights, h, norm=(norm_weight, 1e-6, out, tickets))
        if launch == 0:
            assert np.array_equal(h.copy_to_host(), want_h.copy_to_host())
            assert np.array_equal(out.copy_to_host(), want_x.copy_to_host())
        else:  # the second launch added the experts again: its norm is of that row
            again = cuda.to_device(np.full((n_tok, D), np.nan, np.float32))
            launch_rmsnorm(h, norm_weight, 1e-6, again, threads=module.THREADS)
            assert np.array_equal(out.copy_to_host(), again.copy_to_host())
        assert not tickets.copy_to_host().any()


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
