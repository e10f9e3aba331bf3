"""DeviceHead8Bit (the 8-bit LM head's launches) vs the numpy reference on every path, in the simulator: the weight
stream up to TOK_TILE rows, the tensor-core GEMM past it (rows rounded to bf16 as it takes them), and a vocabulary
that is no multiple of 16 on the stream at every row count. Every element of the logits written."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from expert_service.cuda.head_8bit import MMA_MIN_ROWS, DeviceHead8Bit
from expert_service.cuda.weights import EightBitHead
from expert_service.kernels import expert_quant as q
from expert_service.kernels.linear_q8 import linear_q8_reference
from tests.expert_service.kernels.test_linear_q8 import matrix_block

MAX_ROWS = 7


def bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("V", [48, 37])
def test_every_row_count_matches_reference(code, V):
    rng = np.random.default_rng(V + code)
    D = 32
    block, meta, codes, scale = matrix_block(rng, code, V, D)
    head = DeviceHead8Bit(
        EightBitHead(cuda.to_device(block), cuda.to_device(meta), code), V, D, MAX_ROWS, stream=cuda.default_stream()
    )
    assert head.mma == (V % 16 == 0)
    for R in (1, MMA_MIN_ROWS - 1, MMA_MIN_ROWS, MAX_ROWS):
        x = rng.standard_normal((R, D)).astype(np.float32)
        out = cuda.to_device(np.full((R, V), np.nan, np.float32))
        head.run(cuda.to_device(x), out)
        got = out.copy_to_host()
        on_mma = head.mma and R >= MMA_MIN_ROWS
        ref = linear_q8_reference(bf16(x) if on_mma else x, codes, scale, code)
        assert np.isfinite(got).all(), f"R={R}"
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"R={R} mma={on_mma}")


@pytest.mark.gpu
@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
def test_real_tiles_match_reference(code):
    """On the GPU, with the tile shapes a step's row counts pick (m16 to m64) and a vocabulary of many tiles."""
    rng = np.random.default_rng(code)
    V, D, max_rows = 4000, 512, 64
    block, meta, codes, scale = matrix_block(rng, code, V, D)
    stream = cuda.stream()
    head = DeviceHead8Bit(EightBitHead(cuda.to_device(block), cuda.to_device(meta), code), V, D, max_rows, stream)
    assert head.mma
    for R in (1, 2, MMA_MIN_ROWS - 1, MMA_MIN_ROWS, 16, 33, max_rows):
        x = rng.standard_normal((R, D)).astype(np.float32)
        out = cuda.to_device(np.full((R, V), np.nan, np.float32), stream=stream)
        head.run(cuda.to_device(x, stream=stream), out)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        ref = linear_q8_reference(bf16(x) if R >= MMA_MIN_ROWS else x, codes, scale, code)
        assert np.isfinite(got).all(), f"R={R}"
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"R={R}")
