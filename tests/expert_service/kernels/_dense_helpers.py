"""Shared by the dense-kernel tests: weight dtypes, bf16 rounding, NaN-filled outputs, device checks."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.numeric import SIMULATOR

WEIGHT_DTYPES = [np.float32, np.float16, np.uint16]        # uint16 = bfloat16 bits

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(SIMULATOR or not cuda.is_available(),
                               reason="needs an NVIDIA GPU (run with COLIBRI_TEST_GPU=1)")


def to_weight(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> weight storage dtype (bfloat16 as uint16 bits, round to nearest even)."""
    if np.dtype(dtype) == np.uint16:
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    return x.astype(dtype)


def from_weight(w: np.ndarray) -> np.ndarray:
    """Storage dtype -> the float32 values the kernels compute with."""
    if w.dtype == np.uint16:
        return w.view(ml_dtypes.bfloat16).astype(np.float32)
    return w.astype(np.float32)


def random_weight(rng, shape, dtype, scale=1.0):
    """(storage array, its float32 values): the reference uses the rounded values, so only the kernel's
    accumulation order differs from it."""
    w = to_weight(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale), dtype)
    return w, from_weight(w)


def nan_device(shape, dtype=np.float32):
    """Device output pre-filled with NaN (or -1 for ints), so unwritten elements fail the comparison."""
    fill = np.nan if np.dtype(dtype).kind == "f" else -1
    return cuda.to_device(np.full(shape, fill, dtype=dtype))


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """Every element written (finite) and max |got - want| <= rtol * max(|want|, 1) over the array."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements not written / not finite"
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if got.size else 0.0
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1.0)
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol} * {scale:.3g}"
