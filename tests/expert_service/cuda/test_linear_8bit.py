"""EightBitRows (the 8-bit LM head's and attention projections' launches) vs the numpy reference on every path, in the
simulator: the weight stream up to TOK_TILE rows, the tensor-core GEMM past it (rows rounded to bf16 as it takes
them), a matrix that is no multiple of 16 rows on the stream at every row count, adding into the output, and the
q, k and v rows of one stacked block read through their own offsets, and large steps widened into a dense scratch for
cuBLAS (a host stand-in for cuBLAS in the simulator, the real one on the GPU). Every element of the output
written."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from expert_service.cuda.linear_8bit import (
    MMA_MIN_ROWS,
    SPLIT_MAX_ROWS,
    EightBitRows,
    Matrix8Bit,
    mma_width,
    split_count,
)
from expert_service.kernels import expert_quant as q
from expert_service.kernels.linear_q8 import linear_q8_reference, matrix_meta
from tests.expert_service.kernels.test_linear_q8 import matrix_block

MAX_ROWS = 7


def bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def device_matrix(block, meta, code, n_out, n_in, stream=0):
    return Matrix8Bit(cuda.to_device(block, stream=stream), cuda.to_device(meta, stream=stream), code, n_out, n_in)


def run(rows: EightBitRows, matrix, x, out, accumulate=False, stream=0):
    rows.set_rows(x.shape[0])
    rows.apply(matrix, rows.inputs(cuda.to_device(x, stream=stream)), out, accumulate=accumulate)


def check(got, x, codes, scale, code, on_mma, base=None):
    ref = linear_q8_reference(bf16(x) if on_mma else x, codes, scale, code)
    if base is not None:
        ref = ref + base
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"mma={on_mma}")


@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("V", [48, 37])
@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "add"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-k"])
def test_every_row_count_matches_reference(code, V, accumulate, split, monkeypatch):
    """split: room for split-K partials (the simulator's config splits D = 128 in up to 4 parts of its 32-wide
    steps: each part's sums in its plane, added in order)."""
    import expert_service.kernels.moe_gemm_q8mma as q8mma

    sums = []
    launch = q8mma.launch_split_sum
    monkeypatch.setattr(
        q8mma, "launch_split_sum", lambda partials, *a, **k: sums.append(partials.shape[0]) or launch(partials, *a, **k)
    )
    rng = np.random.default_rng(V + code + 7 * accumulate + 3 * split)
    D = 128 if split else 32
    block, meta, codes, scale = matrix_block(rng, code, V, D)
    matrix = device_matrix(block, meta, code, V, D)
    rows = EightBitRows(MAX_ROWS, D, matrix.takes_mma, cuda.default_stream(), split_outputs=V if split else 0)
    assert rows.mma == (V % 16 == 0) and (rows.partials is not None) == (split and rows.mma)
    for R in (1, MMA_MIN_ROWS - 1, MMA_MIN_ROWS, MAX_ROWS):
        x = rng.standard_normal((R, D)).astype(np.float32)
        base = rng.standard_normal((R, V)).astype(np.float32) if accumulate else np.full((R, V), np.nan, np.float32)
        out = cuda.to_device(base)
        run(rows, matrix, x, out, accumulate)
        check(out.copy_to_host(), x, codes, scale, code, rows.mma and R >= MMA_MIN_ROWS, base if accumulate else None)
    assert sums == (
        [2, 2] if split and rows.mma else []
    )  # past TOK_TILE: 2 tiles of 32 columns, split in 2 for the 4 wanted


@pytest.mark.parametrize("R", [1, MMA_MIN_ROWS + 1])
def test_stacked_rows_read_through_their_offsets(R):
    """q|k|v codes back to back, then their scales: k's meta row points into the middle of both."""
    rng = np.random.default_rng(R)
    code, D, nq, nkv = q.CODE_INT8, 64, 32, 16
    n = nq + 2 * nkv
    block, _, codes, scale = matrix_block(rng, code, n, D)
    scale_at = block.size - 4 * n
    matrices = {
        "qkv": (matrix_meta(code, scale_at), 0, n),
        "q": (matrix_meta(code, scale_at), 0, nq),
        "k": (matrix_meta(code, scale_at + 4 * nq, nq * D), nq, nkv),
        "v": (matrix_meta(code, scale_at + 4 * (nq + nkv), (nq + nkv) * D), nq + nkv, nkv),
    }
    rows = EightBitRows(MMA_MIN_ROWS + 1, D, mma=True, stream=cuda.default_stream(), split_outputs=n)
    x = rng.standard_normal((R, D)).astype(np.float32)
    for name, (meta, first, count) in matrices.items():
        out = cuda.to_device(np.full((R, count), np.nan, np.float32))
        run(rows, device_matrix(block, meta, code, count, D), x, out)
        got = out.copy_to_host()
        assert got.shape == (R, count), name
        check(got, x, codes[first : first + count], scale[first : first + count], code, R >= MMA_MIN_ROWS)


class HostCublas:
    """Cublas.linear on the host (the simulator has no cuBLAS): y (+)= x @ w^T in float64, x and w bf16 bits."""

    def __init__(self):
        self.calls = 0

    def linear(self, x, w, y, accumulate=False):
        from common.dtypes import bf16_to_float32

        assert x.dtype == w.dtype == np.uint16 and y.dtype == np.float32
        xs, ws = (bf16_to_float32(a.copy_to_host()).astype(np.float64) for a in (x, w))
        got = xs @ ws.T + (y.copy_to_host() if accumulate else 0)
        y.copy_to_device(got.astype(np.float32))
        self.calls += 1


def dense_rows(max_rows, D, widen, blas, stream):
    from expert_service.cuda.linear import DeviceLinear

    ws = type("Workspace", (), {"cast": cuda.device_array(max_rows * D, np.uint16, stream=stream)})()
    linear = DeviceLinear(stream, blas, ws, np.uint16)
    return EightBitRows(max_rows, D, True, stream, split_outputs=0, widen_elements=widen, linear=linear)


def check_dense(got, x, codes, scale, code, base=None):
    """The widened matrix's product: bf16 rows times bf16(q * scale), summed exactly (float64)."""
    from expert_service.kernels.dequant_matrix import dequant_matrix_reference

    w = bf16(dequant_matrix_reference(codes, scale, code)).astype(np.float64)
    ref = bf16(x).astype(np.float64) @ w.T + (0 if base is None else base)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    exact = linear_q8_reference(x, codes, scale, code) + (0 if base is None else base)
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())  # bf16 operands


@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "add"])
def test_steps_from_the_dense_threshold_widen_the_matrix_for_cublas(code, accumulate):
    """Below use_dense_rows' count the 8-bit kernels (stream, GEMM); from it the matrix widened into the scratch and
    multiplied by cuBLAS on the rows cast once; 0 turns it off again."""
    rng = np.random.default_rng(code + 2 * accumulate)
    V, D = 48, 32
    block, meta, codes, scale = matrix_block(rng, code, V, D)
    matrix = device_matrix(block, meta, code, V, D)
    blas = HostCublas()
    rows = dense_rows(MAX_ROWS, D, V * D, blas, cuda.default_stream())
    rows.use_dense_rows(MMA_MIN_ROWS + 1)
    assert (
        rows.variant(MMA_MIN_ROWS + 1, (matrix,)) == ("dense",) and rows.variant(MMA_MIN_ROWS, (matrix,))[0] != "dense"
    )
    for R in (1, MMA_MIN_ROWS, MMA_MIN_ROWS + 1, MAX_ROWS):
        x = rng.standard_normal((R, D)).astype(np.float32)
        base = rng.standard_normal((R, V)).astype(np.float32) if accumulate else np.full((R, V), np.nan, np.float32)
        out = cuda.to_device(base)
        calls = blas.calls
        run(rows, matrix, x, out, accumulate)
        dense = R >= MMA_MIN_ROWS + 1
        assert rows.on_dense == dense and not (dense and rows.on_mma) and blas.calls == calls + dense
        if dense:
            check_dense(out.copy_to_host(), x, codes, scale, code, base if accumulate else None)
        else:
            check(out.copy_to_host(), x, codes, scale, code, R >= MMA_MIN_ROWS, base if accumulate else None)
    rows.use_dense_rows(0)
    rows.set_rows(MAX_ROWS)
    assert not rows.on_dense and rows.on_mma


def test_each_matrix_is_widened_from_its_own_block_with_views_made_once(monkeypatch):
    """Two matrices of one shape through one scratch, in turn: each step widens the step's own matrix (a stale
    widening would multiply by the other's), and each matrix's checked launch is made on its first widened step only."""
    import expert_service.cuda.linear_8bit as linear_8bit

    made = []

    class Counted(linear_8bit.MatrixWidening):
        def __init__(self, *args):
            made.append(args[0])
            super().__init__(*args)

    monkeypatch.setattr(linear_8bit, "MatrixWidening", Counted)
    rng = np.random.default_rng(7)
    V, D = 48, 32
    parts = [matrix_block(rng, code, V, D) for code in (q.CODE_INT8, q.CODE_FP8)]
    matrices = [
        device_matrix(block, meta, code, V, D) for (block, meta, _, _), code in zip(parts, (q.CODE_INT8, q.CODE_FP8))
    ]
    rows = dense_rows(MAX_ROWS, D, V * D, HostCublas(), cuda.default_stream())
    rows.use_dense_rows(1)
    for i in (0, 1, 0, 1):
        x = rng.standard_normal((MAX_ROWS, D)).astype(np.float32)
        out = cuda.to_device(np.full((MAX_ROWS, V), np.nan, np.float32))
        run(rows, matrices[i], x, out, False)
        _, _, codes, scale = parts[i]
        check_dense(out.copy_to_host(), x, codes, scale, matrices[i].code)
    assert made == [matrices[0].block, matrices[1].block]


def test_without_a_scratch_or_cublas_no_step_widens():
    rows = EightBitRows(MAX_ROWS, 32, True, cuda.default_stream(), widen_elements=64)  # no DeviceLinear
    rows.use_dense_rows(1)
    rows.set_rows(MAX_ROWS)
    assert not rows.on_dense and rows.on_mma
    with pytest.raises(ValueError, match="dense_min_rows -1: 0"):
        rows.use_dense_rows(-1)
    small = dense_rows(MAX_ROWS, 32, 32 * 16, HostCublas(), cuda.default_stream())  # holds [16, 32]
    small.use_dense_rows(1)
    small.set_rows(2)
    big = device_matrix(*matrix_block(np.random.default_rng(0), q.CODE_INT8, 48, 32)[:2], q.CODE_INT8, 48, 32)
    with pytest.raises(ValueError, match=r"a \[48, 32\] matrix does not fit the 512-element scratch"):
        small.apply(
            big, small.inputs(cuda.to_device(np.ones((2, 32), np.float32))), cuda.device_array((2, 48), np.float32)
        )


def test_refusals():
    rows = EightBitRows(3, 16, mma=False, stream=cuda.default_stream())
    with pytest.raises(ValueError, match="4 rows: laid out for 1 to 3"):
        rows.set_rows(4)
    rows.set_rows(2)
    with pytest.raises(ValueError, match="x has 3 rows, set_rows said 2"):
        rows.inputs(cuda.to_device(np.ones((3, 16), np.float32)))


def test_split_count_fills_the_gpu_within_the_partials():
    from expert_service.kernels.moe_gemm_q8mma import CONFIGS

    m16 = CONFIGS["m16"]  # BK 128: K = 4096 is 32 steps
    assert split_count(32, 4096, 16, 4096, 1 << 30, 264, m16) == 8  # mixtral's o over 16 rows: 32 tiles
    assert split_count(32, 4096, 16, 4096, 16 * 4096 * 3, 264, m16) == 3  # three planes fit
    assert split_count(300, 4096, 16, 4096, 1 << 30, 264, m16) == 1  # tiles enough
    assert split_count(32, 4096, SPLIT_MAX_ROWS + 1, 4096, 1 << 30, 264, m16) == 1
    assert split_count(4, 256, 16, 512, 1 << 30, 264, m16) == 2  # K of two steps: two parts at most
    assert split_count(4, 128 * 6, 16, 512, 1 << 30, 264, m16) == 6
    assert split_count(4, 128 * 11, 16, 512, 1 << 30, 264, m16) == 6  # 8 wanted: 2 steps a part, the last 1


def test_mma_width_covers_every_row_count():
    from expert_service.kernels.moe_gemm_q8mma import choose_config

    for max_rows in (MMA_MIN_ROWS, 11, 12, 63, 64, 255, 256, 300, 1000):
        width = mma_width(max_rows)
        needs = [-(-r // choose_config(r, 1).block_m) * choose_config(r, 1).block_m for r in range(1, max_rows + 1)]
        assert width == max(needs[MMA_MIN_ROWS - 1 :]), max_rows


@pytest.mark.gpu
@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "add"])
@pytest.mark.parametrize("D", [512, 96])  # 96: a K tail in every tile config (BK 64 and 128)
def test_real_tiles_match_reference(code, accumulate, D):
    """On the GPU, with the tile shapes a step's row counts pick (m16 to m128) and a matrix of many tiles."""
    rng = np.random.default_rng(code)
    V, max_rows = 4000, 300
    block, meta, codes, scale = matrix_block(rng, code, V, D)
    stream = cuda.stream()
    matrix = device_matrix(block, meta, code, V, D, stream)
    rows = EightBitRows(max_rows, D, matrix.takes_mma, stream, split_outputs=V)
    assert rows.mma
    for R in (1, 2, MMA_MIN_ROWS - 1, MMA_MIN_ROWS, 16, 33, 64, 257, max_rows):
        x = rng.standard_normal((R, D)).astype(np.float32)
        base = rng.standard_normal((R, V)).astype(np.float32) if accumulate else np.full((R, V), np.nan, np.float32)
        out = cuda.to_device(base, stream=stream)
        run(rows, matrix, x, out, accumulate, stream)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        check(got, x, codes, scale, code, R >= MMA_MIN_ROWS, base if accumulate else None)


@pytest.mark.gpu
@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("accumulate", [False, True], ids=["store", "add"])
def test_widened_steps_on_cublas_match_reference(code, accumulate):
    """On the GPU with cuBLAS: large steps widened into the scratch, a matrix of many tiles."""
    from expert_service.cuda.cublas import WORKSPACE_BYTES, Cublas

    rng = np.random.default_rng(10 + code)
    V, D, max_rows = 4000, 512, 300
    block, meta, codes, scale = matrix_block(rng, code, V, D)
    stream = cuda.stream()
    matrix = device_matrix(block, meta, code, V, D, stream)
    blas = Cublas(stream, cuda.device_array(WORKSPACE_BYTES, np.uint8, stream=stream))
    rows = dense_rows(max_rows, D, V * D, blas, stream)
    rows.use_dense_rows(32)
    for R in (32, 257, max_rows):
        x = rng.standard_normal((R, D)).astype(np.float32)
        base = rng.standard_normal((R, V)).astype(np.float32) if accumulate else np.full((R, V), np.nan, np.float32)
        out = cuda.to_device(base, stream=stream)
        run(rows, matrix, x, out, accumulate, stream)
        assert rows.on_dense
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        check_dense(got, x, codes, scale, code, base if accumulate else None)
