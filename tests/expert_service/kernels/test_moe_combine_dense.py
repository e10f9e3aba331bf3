import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.moe_combine_dense import launch_moe_combine_dense


@pytest.mark.parametrize("E,T,K,D", [(3, 1, 1, 5), (7, 4, 3, 33), (8, 2, 2, 64)])
def test_matches_numpy(E, T, K, D):
    rng = np.random.default_rng(E * T)
    y = rng.standard_normal((E, T, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    weights = rng.random((T, K)).astype(np.float32)
    h = rng.standard_normal((T, D)).astype(np.float32)
    expected = h + np.einsum("tk,tkd->td", weights, y[ids, np.arange(T)[:, None]])
    out = cuda.to_device(h)
    launch_moe_combine_dense(cuda.to_device(y), cuda.to_device(ids), cuda.to_device(weights), out)
    np.testing.assert_allclose(out.copy_to_host(), expected, rtol=1e-5, atol=1e-6)
