"""split_sum (the planes of a split-K GEMM added in a fixed order) vs its reference: stored and added into out,
every element written, bit-equal to the float32 sums in plane order (simulator)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.split_sum import launch_split_sum, split_sum_reference


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "add"])
def test_matches_reference_bit_for_bit(splits, accumulate):
    rng = np.random.default_rng(10 * splits + accumulate)
    R, N = 3, 70
    partials = rng.standard_normal((splits, R, N)).astype(np.float32) * np.float32(1e3)
    base = rng.standard_normal((R, N)).astype(np.float32) if accumulate else np.full((R, N), np.nan, np.float32)
    out = cuda.to_device(base)
    launch_split_sum(cuda.to_device(partials), out, accumulate)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got, split_sum_reference(partials, base, accumulate))
    assert np.isfinite(got).all()


def test_refusals():
    out = cuda.to_device(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"partials must be float32 \[splits, R, N\]"):
        launch_split_sum(cuda.to_device(np.zeros((2, 4), np.float32)), out)
    with pytest.raises(ValueError, match="out must be C-contiguous float32 \\[3, 4\\]"):
        launch_split_sum(cuda.to_device(np.zeros((2, 3, 4), np.float32)), out)
