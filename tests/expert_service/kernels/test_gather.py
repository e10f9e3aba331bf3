import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.gather import launch_gather_rows
from tests.helpers import STORAGE_DTYPES, awkward_floats, bf16_bits


# (2, 300, 3, 1): rows wider than a block, so a small step spreads each row over several blocks
@pytest.mark.parametrize("rows,width,n,divisor", [(5, 7, 9, 2), (1, 33, 1, 1), (6, 3, 6, 1), (2, 300, 3, 1)])
def test_gather_rows_matches_numpy(rows, width, n, divisor):
    rng = np.random.default_rng(rows * 10 + n)
    src = rng.standard_normal((rows, width)).astype(np.float32)
    index = rng.integers(0, rows * divisor, size=n).astype(np.int32)
    dst = cuda.to_device(np.full((n, width), np.nan, dtype=np.float32))
    launch_gather_rows(cuda.to_device(src), cuda.to_device(index), dst, divisor)
    np.testing.assert_array_equal(dst.copy_to_host(), src[index // divisor])


@pytest.mark.parametrize("dtype", [d for d in STORAGE_DTYPES if d != np.float32])
def test_gather_rows_into_16_bit_rounds_each_element(dtype):
    """The grouped-order gather of per-expert GEMM inputs writes the weights' 16-bit dtype directly: each element
    rounded as the cast kernel rounds it (bfloat16: nearest even, NaN kept), every element written."""
    rng = np.random.default_rng(7)
    src = awkward_floats(rng, (6, 37))
    index = rng.integers(0, 12, size=11).astype(np.int32)
    fill = np.nan if np.dtype(dtype) == np.float16 else 0xFFFF  # 0xFFFF: a NaN no rounding produces
    dst = cuda.to_device(np.full((11, 37), fill, dtype))
    launch_gather_rows(cuda.to_device(src), cuda.to_device(index), dst, 2)
    want = src[index // 2]
    got = dst.copy_to_host()
    if np.dtype(dtype) == np.uint16:
        np.testing.assert_array_equal(got, bf16_bits(want))
    else:
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(got, want.astype(np.float16))


@pytest.mark.gpu
def test_gather_rows_gpu_large():
    rng = np.random.default_rng(0)
    src = rng.standard_normal((512, 4096)).astype(np.float32)
    index = rng.integers(0, 1024, size=1024).astype(np.int32)
    dst = cuda.device_array((1024, 4096), dtype=np.float32)
    launch_gather_rows(cuda.to_device(src), cuda.to_device(index), dst, 2)
    np.testing.assert_array_equal(dst.copy_to_host(), src[index // 2])
    bf = cuda.device_array((1024, 4096), dtype=np.uint16)
    launch_gather_rows(cuda.to_device(src), cuda.to_device(index), bf, 2)
    np.testing.assert_array_equal(bf.copy_to_host(), bf16_bits(src[index // 2]))
