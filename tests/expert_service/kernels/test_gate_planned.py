"""gate_planned vs numpy (route_planned on x @ router.T): the plan's ids copied, softmax over just the planned
experts' logits, NaN rows stay NaN; in the simulator and (gpu) on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.moe import route, route_planned
from expert_service.kernels.gate_planned import launch_gate_planned
from tests.helpers import STORAGE_DTYPES, assert_close, nan_device, random_ids, random_weight


def _run(x, router, planned):
    T, K = planned.shape
    ids, weights = nan_device((T, K), np.int32), nan_device((T, K))
    launch_gate_planned(cuda.to_device(x), cuda.to_device(router), cuda.to_device(planned), ids, weights)
    return ids.copy_to_host(), weights.copy_to_host()


def _check(rng, T, K, E, D, dtype):
    x = rng.standard_normal((T, D), dtype=np.float32)
    router, router_f = random_weight(rng, (E, D), dtype, scale=D**-0.5)
    planned = random_ids(rng, T, K, E)
    ids, weights = _run(x, router, planned)
    np.testing.assert_array_equal(ids, planned)
    assert_close(weights, route_planned(x @ router_f.T, planned), 1e-5)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize(
    "T,K,E,D,dtype",
    [(1, 1, 3, 5, np.float32), (1, 2, 3, 5, np.float16), (7, 2, 5, 37, np.uint16), (3, 8, 40, 64, np.uint16)],
)
def test_gate_planned_matches_reference(T, K, E, D, dtype):
    _check(np.random.default_rng(T * 10 + K), T, K, E, D, dtype)


def test_gate_planned_equals_exact_weights_on_the_exact_experts():
    """Planned = the exact top-k: the weights are the renormalised top-k weights (Mixtral's routing)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 24), dtype=np.float32)
    router = rng.standard_normal((8, 24), dtype=np.float32)
    exact_ids, exact_weights = route(x @ router.T, 2, normalize=True)
    ids, weights = _run(x, router, exact_ids.astype(np.int32))
    assert_close(weights, exact_weights, 1e-5)


def test_gate_planned_non_finite_rows_give_nan_weights():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 16), dtype=np.float32)
    x[1, 4] = np.nan
    x[2, 0] = np.inf
    router = rng.standard_normal((6, 16), dtype=np.float32)
    planned = random_ids(rng, 3, 2, 6)
    ids, weights = _run(x, router, planned)
    np.testing.assert_array_equal(ids, planned)  # ids are valid whatever the logits
    assert np.isfinite(weights[0]).all() and np.isnan(weights[1]).all()
    assert np.array_equal(np.isnan(weights[2]), np.isnan(route_planned(x[2:] @ router.T, planned[2:])[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_gate_planned_gpu(dtype, T):
    rng = np.random.default_rng(T)
    _check(rng, T, 8, 128, 2048, dtype)  # qwen3moe-shape router
    _check(rng, T, 2, 8, 4096, dtype)  # mixtral-shape router
