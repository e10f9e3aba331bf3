import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.gather import launch_gather_rows


@pytest.mark.parametrize("rows,width,n,divisor", [(5, 7, 9, 2), (1, 33, 1, 1), (6, 3, 6, 1)])
def test_gather_rows_matches_numpy(rows, width, n, divisor):
    rng = np.random.default_rng(rows * 10 + n)
    src = rng.standard_normal((rows, width)).astype(np.float32)
    index = rng.integers(0, rows * divisor, size=n).astype(np.int32)
    dst = cuda.to_device(np.full((n, width), np.nan, dtype=np.float32))
    launch_gather_rows(cuda.to_device(src), cuda.to_device(index), dst, divisor)
    np.testing.assert_array_equal(dst.copy_to_host(), src[index // divisor])


@pytest.mark.gpu
def test_gather_rows_gpu_large():
    rng = np.random.default_rng(0)
    src = rng.standard_normal((512, 4096)).astype(np.float32)
    index = rng.integers(0, 1024, size=1024).astype(np.int32)
    dst = cuda.device_array((1024, 4096), dtype=np.float32)
    launch_gather_rows(cuda.to_device(src), cuda.to_device(index), dst, 2)
    np.testing.assert_array_equal(dst.copy_to_host(), src[index // 2])
