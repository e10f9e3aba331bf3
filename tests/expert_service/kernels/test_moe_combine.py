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

    rng = np.random.default_rng(2)
    n_tok, top_k, D = 2, 8, 3 * module.THREADS + 8  # four blocks a token in the simulator and on a GPU
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
