"""Elementwise kernels (silu_mul, shared-expert sigmoid gate, clamp, bias add, 16-bit casts) vs numpy."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.elementwise import (launch_add_bias, launch_cast, launch_clamp,
                                                launch_sigmoid_gate_add, launch_silu_mul)
from expert_service.cpu.layers.moe import silu

from tests.helpers import STORAGE_DTYPES, assert_close, from_storage, nan_device, random_weight, to_storage


def _check_all(rng, rows, cols, threads):
    g = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(4.0)
    u = rng.standard_normal((rows, cols), dtype=np.float32)
    h = nan_device((rows, cols))
    launch_silu_mul(cuda.to_device(g), cuda.to_device(u), h, threads=threads)
    assert_close(h.copy_to_host(), silu(g) * u, 1e-5)

    base = rng.standard_normal((rows, cols), dtype=np.float32)
    shared = rng.standard_normal((rows, cols), dtype=np.float32)
    gate = rng.standard_normal((rows, 1), dtype=np.float32) * np.float32(3.0)
    d_out = cuda.to_device(base)
    launch_sigmoid_gate_add(d_out, cuda.to_device(shared), cuda.to_device(gate), threads=threads)
    assert_close(d_out.copy_to_host(), base + shared / (np.float32(1.0) + np.exp(-gate)), 1e-5)

    x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(10.0)
    x.flat[0] = np.nan
    d_x = cuda.to_device(x)
    launch_clamp(d_x, 8.0, threads=threads)
    np.testing.assert_array_equal(d_x.copy_to_host(), np.clip(x, -8.0, 8.0))

    for dtype in STORAGE_DTYPES:
        b, bf = random_weight(rng, (cols,), dtype)
        d_y = cuda.to_device(base)
        launch_add_bias(d_y, cuda.to_device(b), threads=threads)
        assert_close(d_y.copy_to_host(), base + bf, 1e-6)

    for dtype in (np.float16, np.uint16):
        out = cuda.to_device(np.full((rows, cols), 0x7E01 if dtype is np.uint16 else np.nan, dtype=dtype))
        launch_cast(cuda.to_device(x), out, threads=threads)
        # values compared (NaN payloads differ between numpy and the GPU's cvt), NaN positions must match
        np.testing.assert_array_equal(from_storage(out.copy_to_host()), from_storage(to_storage(x, dtype)))


@pytest.mark.parametrize("rows,cols", [(1, 5), (3, 37)])
def test_elementwise_matches_reference(rows, cols):
    _check_all(np.random.default_rng(cols), rows, cols, threads=32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 33, 512])
def test_elementwise_gpu(rows):
    rng = np.random.default_rng(rows)
    for cols in (14336, 2048, 1001):
        _check_all(rng, rows, cols, threads=256)
