"""gate_fused (router GEMV + softmax + top-k + renormalisation in one launch, last block of each token selects)
vs numpy: the logits against
x @ Wr^T (float64 products of the stored weight values), then ids / weights against
expert_service.cpu.layers.moe.route on the kernel's own logits (so near-ties cannot flip on rounding), and
against the two-launch path (gate_topk) semantics for non-finite rows; the same ids and weights, bit for bit,
over many relaunches on one ticket counter."""

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.moe import route
from expert_service.kernels.gate_fused import MAX_TOKENS, launch_gate_fused
from tests.helpers import random_weight


def run(x, w, top_k, normalize, repeat=1):
    """Launch `repeat` times on the same buffers (the ticket counter must come back to zero each time)."""
    n_tok, n_exp = x.shape[0], w.shape[0]
    ids = cuda.to_device(np.full((n_tok, top_k), -7, np.int32))
    weights = cuda.to_device(np.full((n_tok, top_k), np.nan, np.float32))
    logits = cuda.to_device(np.full((n_tok, n_exp), np.nan, np.float32))
    counter = cuda.to_device(np.zeros(n_tok + 3, np.int32))
    d_x, d_w = cuda.to_device(x), cuda.to_device(w)
    for _ in range(repeat):
        launch_gate_fused(d_x, d_w, ids, weights, normalize, logits, counter)
    assert (counter.copy_to_host() == 0).all(), "the last block of each token resets its counter"
    return ids.copy_to_host(), weights.copy_to_host(), logits.copy_to_host()


def check(rng, n_tok, n_exp, top_k, D, dtype, normalize):
    w, w32 = random_weight(rng, (n_exp, D), dtype, scale=1.0 / np.sqrt(D))
    x = rng.standard_normal((n_tok, D)).astype(np.float32) * 3
    ids, weights, logits = run(x, w, top_k, normalize)
    ref_logits = x.astype(np.float64) @ w32.T.astype(np.float64)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4 * np.abs(ref_logits).max())
    ref_ids, ref_w = route(logits, top_k, normalize)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=1e-7)
    ids2, weights2, _ = run(x, w, top_k, normalize, repeat=2)  # relaunch on the same buffers
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(weights2, weights)


@pytest.mark.parametrize(
    "n_tok,n_exp,top_k,D,dtype,normalize",
    [
        (1, 8, 2, 64, np.uint16, True),  # wide bf16 path, rows split over warps (E small)
        (2, 3, 2, 48, np.uint16, True),  # one block per token
        (1, 4, 2, 520, np.uint16, True),  # two warps per row
        (2, 60, 4, 40, np.uint16, True),  # E not a multiple of 32 (the simulator's cost grows with T x E)
        (2, 7, 1, 37, np.uint16, False),  # odd D: element loads
        (1, 128, 8, 32, np.float16, True),
        (1, 5, 3, 24, np.float32, False),
        (1, 256, 8, 16, np.uint16, True),
    ],
)
def test_matches_reference(n_tok, n_exp, top_k, D, dtype, normalize):
    check(np.random.default_rng(n_exp * 10 + D), n_tok, n_exp, top_k, D, dtype, normalize)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_rows_still_give_valid_ids(bad):
    rng = np.random.default_rng(3)
    w, _ = random_weight(rng, (16, 24), np.uint16)
    x = rng.standard_normal((3, 24)).astype(np.float32)
    x[1, 5] = bad
    ids, weights, logits = run(x, w, 4, True)
    assert ((ids >= 0) & (ids < 16)).all() and all(len(set(row)) == 4 for row in ids.tolist())
    assert np.isnan(weights[1]).all()
    for t in (0, 2):
        ref_ids, ref_w = route(logits[t : t + 1], 4, True)
        np.testing.assert_array_equal(ids[t : t + 1], ref_ids)
        np.testing.assert_allclose(weights[t : t + 1], ref_w, rtol=1e-5, atol=1e-7)


def test_ties_go_to_the_lower_index():
    w = np.zeros((8, 8), np.float32)
    for e, v in enumerate([1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 0.5, 0.5]):
        w[e, 0] = v
    x = np.zeros((1, 8), np.float32)
    x[0, 0] = 1.0
    ids, weights, logits = run(x, w, 5, False)
    assert ids.tolist() == [[1, 2, 4, 0, 3]]


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        run(np.ones((2, 8), np.float32), np.ones((4, 8), np.float32), 5, True)  # K > E
    with pytest.raises(ValueError):
        run(np.ones((2, 8), np.float32), np.ones((300, 8), np.float32), 2, True)  # E > 256
    with pytest.raises(ValueError):  # counter too short
        launch_gate_fused(
            *(cuda.to_device(np.ones(s, np.float32)) for s in ((3, 8), (4, 8))),
            cuda.to_device(np.zeros((3, 2), np.int32)),
            cuda.to_device(np.zeros((3, 2), np.float32)),
            True,
            cuda.to_device(np.zeros((3, 4), np.float32)),
            cuda.to_device(np.zeros(2, np.int32)),
        )


def test_refuses_more_tokens_than_the_grid_holds():
    T = MAX_TOKENS + 1
    with pytest.raises(ValueError, match=f"at most {MAX_TOKENS} tokens"):
        launch_gate_fused(
            cuda.to_device(np.ones((T, 8), np.float32)),
            cuda.to_device(np.ones((4, 8), np.float32)),
            cuda.to_device(np.zeros((T, 2), np.int32)),
            cuda.to_device(np.zeros((T, 2), np.float32)),
            True,
            cuda.to_device(np.zeros((T, 4), np.float32)),
            cuda.to_device(np.zeros(T, np.int32)),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("n_exp,top_k,D", [(8, 2, 4096), (128, 8, 2048), (60, 4, 2048), (64, 8, 2049)])
@pytest.mark.parametrize("n_tok", [1, 16, 64])
def test_gpu_realistic(n_tok, n_exp, top_k, D):
    check(np.random.default_rng(n_tok + n_exp), n_tok, n_exp, top_k, D, np.uint16, True)


def assert_relaunches_select_the_same(rng, n_tok, n_exp, top_k, D, repeat):
    """The last-block ticket selects the same experts launch after launch on one counter: before each launch the logits are poisoned with NaN (a last block reading one before its writer's
    store is visible would give a NaN row: ids 0..K-1, NaN weights) and ids / weights reset to sentinels (a launch
    whose last block never ran would leave them)."""
    w, _ = random_weight(rng, (n_exp, D), np.uint16, scale=1.0 / np.sqrt(D))
    x = rng.standard_normal((n_tok, D)).astype(np.float32) * 3
    default = run(x, w, top_k, True)
    ids = cuda.to_device(np.zeros((n_tok, top_k), np.int32))
    weights = cuda.to_device(np.zeros((n_tok, top_k), np.float32))
    logits = cuda.to_device(np.zeros((n_tok, n_exp), np.float32))
    counter = cuda.to_device(np.zeros(n_tok, np.int32))
    d_x, d_w = cuda.to_device(x), cuda.to_device(w)
    for i in range(repeat):
        logits.copy_to_device(np.full((n_tok, n_exp), np.nan, np.float32))
        ids.copy_to_device(np.full((n_tok, top_k), -7, np.int32))
        weights.copy_to_device(np.full((n_tok, top_k), -1.0, np.float32))
        launch_gate_fused(d_x, d_w, ids, weights, True, logits, counter)
        np.testing.assert_array_equal(ids.copy_to_host(), default[0], err_msg=f"launch {i}")
        np.testing.assert_array_equal(weights.copy_to_host(), default[1], err_msg=f"launch {i}")
    assert (counter.copy_to_host() == 0).all(), "the last block of each token resets its counter"


def test_relaunches_select_the_same():
    assert_relaunches_select_the_same(np.random.default_rng(3), 2, 40, 8, 64, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("n_exp,top_k,D", [(8, 2, 4096), (128, 8, 2048)])
@pytest.mark.parametrize("n_tok", [1, 16, 64])
def test_relaunches_select_the_same_gpu(n_tok, n_exp, top_k, D):
    # the logits buffer is poisoned with NaN before every launch, so a stale read changes the selection
    assert_relaunches_select_the_same(np.random.default_rng(n_tok + n_exp), n_tok, n_exp, top_k, D, 200)
