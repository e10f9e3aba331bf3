"""dequant_matrix vs its numpy reference: an 8-bit matrix (int8, fp8) with per-row scales widened into bf16 / f16 /
f32, whole blocks and the rows of a stacked block picked by its offsets (k of q|k|v), rows longer than one block's
chunks; every element written; one-line refusals (simulator on small shapes)."""

import numpy as np
import pytest
from numba import cuda

from common import dtypes
from expert_service.kernels import expert_quant as q
from expert_service.kernels.dequant_matrix import THREADS, VALUES, dequant_matrix_reference, launch_dequant_matrix
from expert_service.kernels.linear_q8 import matrix_meta
from tests.expert_service.kernels.test_linear_q8 import matrix_block

SENTINEL = {np.uint16: 0x7FC1, np.float16: np.float16(np.nan), np.float32: np.float32(np.nan)}


def widened(out: np.ndarray) -> np.ndarray:
    return dtypes.bf16_to_float32(out) if out.dtype == np.uint16 else out.astype(np.float32)


@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.float32])
@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
def test_matches_reference(code, dtype):
    rng = np.random.default_rng(10 * code + np.dtype(dtype).itemsize)
    n_out, K = 23, VALUES * THREADS + 48  # a row spans two blocks, the second partly idle
    block, meta, codes, scale = matrix_block(rng, code, n_out, K)
    out = cuda.to_device(np.full((n_out, K), SENTINEL[dtype], dtype))
    launch_dequant_matrix(cuda.to_device(block), cuda.to_device(meta), code, n_out, K, out)
    got = out.copy_to_host()
    ref = dequant_matrix_reference(codes, scale, code)
    if dtype == np.uint16:
        assert not (got == SENTINEL[dtype]).any()  # every element written
    else:
        assert np.isfinite(got).all()
    if dtype == np.float32:
        np.testing.assert_array_equal(got, ref)  # one float32 product, as the reference
    else:
        np.testing.assert_allclose(widened(got), ref, rtol=2.0**-8 if dtype == np.uint16 else 2.0**-11, atol=0)
        rounded = dtypes.float32_to_bf16(ref) if dtype == np.uint16 else ref.astype(np.float16)
        np.testing.assert_array_equal(got, rounded)  # rounded to nearest, as the host rounds


def test_a_stacked_blocks_rows_through_their_offsets():
    """A meta row whose codes and scales start inside the block widens only those rows (the v rows of q|k|v)."""
    rng = np.random.default_rng(5)
    code, K, n_before, n_out = q.CODE_INT8, 64, 32, 16
    block, _, codes, scale = matrix_block(rng, code, n_before + n_out, K)
    scale_at = block.size - 4 * (n_before + n_out)
    meta = matrix_meta(code, scale_at + 4 * n_before, n_before * K)
    out = cuda.to_device(np.full((n_out, K), np.nan, np.float32))
    launch_dequant_matrix(cuda.to_device(block), cuda.to_device(meta), code, n_out, K, out)
    want = dequant_matrix_reference(codes[n_before:], scale[n_before:], code)
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_refusals():
    rng = np.random.default_rng(1)
    block, meta, _, _ = matrix_block(rng, q.CODE_INT8, 16, 32)
    dblock, dmeta = cuda.to_device(block), cuda.to_device(meta)
    out = cuda.to_device(np.zeros((16, 32), np.uint16))
    with pytest.raises(ValueError, match="int8 or fp8"):
        launch_dequant_matrix(dblock, dmeta, q.CODE_BF16, 16, 32, out)
    with pytest.raises(ValueError, match="multiple of 16 values"):
        launch_dequant_matrix(dblock, dmeta, q.CODE_INT8, 16, 24, cuda.to_device(np.zeros((16, 24), np.uint16)))
    with pytest.raises(ValueError, match=r"out must be \[16, 32\]"):
        launch_dequant_matrix(dblock, dmeta, q.CODE_INT8, 16, 32, cuda.to_device(np.zeros((16, 32), np.int32)))
    with pytest.raises(ValueError, match="block must be uint8"):
        launch_dequant_matrix(cuda.to_device(block.view(np.uint16)), dmeta, q.CODE_INT8, 16, 32, out)
