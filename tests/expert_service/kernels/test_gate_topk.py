"""gate_topk kernel vs expert_service.cpu.layers.moe.route (simulator; realistic sizes on a GPU)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.moe import route
from expert_service.kernels.gate_topk import launch_gate_topk


def run(logits, top_k, normalize):
    n_tok = logits.shape[0]
    ids = cuda.to_device(np.full((n_tok, top_k), -7, np.int32))
    weights = cuda.to_device(np.full((n_tok, top_k), np.nan, np.float32))
    launch_gate_topk(cuda.to_device(logits), ids, weights, normalize)
    return ids.copy_to_host(), weights.copy_to_host()


@pytest.mark.parametrize(
    "n_tok,n_exp,top_k,normalize",
    [(1, 8, 2, True), (33, 60, 4, True), (3, 7, 1, False), (2, 256, 8, True), (4, 128, 3, False)],
)
def test_matches_reference(n_tok, n_exp, top_k, normalize):
    rng = np.random.default_rng(n_tok * 1000 + n_exp)
    logits = (rng.standard_normal((n_tok, n_exp)) * 3).astype(np.float32)
    ids, weights = run(logits, top_k, normalize)
    ref_ids, ref_w = route(logits, top_k, normalize)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=1e-7)


def test_ties_go_to_the_lower_index():
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 0.5, 0.5]], np.float32)
    ids, weights = run(logits, 5, False)
    assert ids.tolist() == [[1, 2, 4, 0, 3]] == route(logits, 5, False)[0].tolist()
    np.testing.assert_allclose(weights, route(logits, 5, False)[1], rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_rows_still_give_valid_ids(bad):
    """The expert kernels index weights with the ids: a NaN/inf router row must not yield ids outside [0, E)."""
    rng = np.random.default_rng()
    logits = rng.standard_normal((3, 16)).astype(np.float32)
    logits[1, rng.integers(16)] = bad
    ids, weights = run(logits, 4, True)
    assert ((ids >= 0) & (ids < 16)).all() and all(len(set(row)) == 4 for row in ids.tolist())
    assert np.isnan(weights[1]).all()
    for t in (0, 2):  # finite rows are unaffected
        ref_ids, ref_w = route(logits[t : t + 1], 4, True)
        np.testing.assert_array_equal(ids[t : t + 1], ref_ids)
        np.testing.assert_allclose(weights[t : t + 1], ref_w, rtol=1e-5, atol=1e-7)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        run(np.zeros((2, 4), np.float32) + 1, 5, True)  # K > E
    with pytest.raises(ValueError):
        run(np.ones((2, 300), np.float32), 2, True)  # E > 256


@pytest.mark.gpu
@pytest.mark.parametrize("n_exp,top_k", [(8, 2), (128, 8), (60, 4)])
@pytest.mark.parametrize("n_tok", [1, 16, 64, 512])
def test_gpu_realistic(n_tok, n_exp, top_k):
    rng = np.random.default_rng(n_tok + n_exp)
    logits = (rng.standard_normal((n_tok, n_exp)) * 2).astype(np.float32)
    ids, weights = run(logits, top_k, True)
    ref_ids, ref_w = route(logits, top_k, True)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=1e-7)
