"""linear_q8 (a dense matrix on 8-bit rows with per-row scales: the 8-bit LM head) vs its numpy reference: one
row (one slot running the block) and several (grouped, a partial token tile), int8 and fp8, a row count that is no
multiple of a block's rows, the offsets read from meta on the device or given at launch (simulator on tiny
shapes)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import expert_quant as q
from expert_service.kernels.linear_q8 import launch_linear_q8, linear_q8_reference, matrix_meta, row_bounds
from expert_service.kernels.moe_q8 import DECODE_SHAPE


def matrix_block(rng, code, n_out, K):
    """(uint8 block: codes then scales at a 64-byte-aligned offset, meta, codes [n_out, K], scales [n_out])."""
    w = rng.standard_normal((n_out, K)).astype(np.float32) * rng.uniform(0.05, 2.0, (n_out, 1)).astype(np.float32)
    raw, scale = q.quantize(w, code, q.SCALE_CHANNEL)
    scale_at = -(-raw.size // 64) * 64
    block = np.zeros(scale_at + scale.nbytes, np.uint8)
    block[: raw.size] = raw
    block[scale_at:] = scale.view(np.uint8)
    return block, matrix_meta(code, scale_at), raw.reshape(n_out, K), scale


def host_row(meta) -> tuple[int, ...]:
    return tuple(int(v) for v in meta[0])


@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("given", [False, True])
def test_matches_reference(code, rows, given):
    rng = np.random.default_rng(100 * code + rows)
    n_out, K = 37, 48  # 37: the last row block is partial
    block, meta, codes, scale = matrix_block(rng, code, n_out, K)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    out = cuda.to_device(np.full((rows, n_out), np.nan, np.float32))  # every element must be written
    bounds = cuda.to_device(row_bounds(8))
    layout = host_row(meta) if given else None
    launch_linear_q8(
        cuda.to_device(x), cuda.to_device(block), cuda.to_device(meta), code, n_out, out, bounds, layout=layout
    )
    got = out.copy_to_host()
    ref = linear_q8_reference(x, codes, scale, code)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows", [1, 3])
def test_adds_into_out_through_a_stacked_blocks_offsets(rows):
    """accumulate: out += x @ W^T; a meta row whose matrix and scales start inside the block (k of q|k|v)."""
    rng = np.random.default_rng(rows)
    code, K, n_first, n_out = q.CODE_INT8, 32, 16, 21
    block, _, codes, scale = matrix_block(rng, code, n_first + n_out, K)
    scale_at = block.size - 4 * (n_first + n_out)
    meta = matrix_meta(code, scale_at + 4 * n_first, n_first * K)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    base = rng.standard_normal((rows, n_out)).astype(np.float32)
    ref = base + linear_q8_reference(x, codes[n_first:], scale[n_first:], code)
    for layout in (None, host_row(meta)):
        out = cuda.to_device(base)
        args = (cuda.to_device(block), cuda.to_device(meta), code, n_out, out, cuda.to_device(row_bounds(4)))
        launch_linear_q8(cuda.to_device(x), *args, accumulate=True, layout=layout)
        np.testing.assert_allclose(out.copy_to_host(), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows", [1, 3])
def test_a_given_layout_is_what_the_kernel_reads(rows):
    """With the layout given at launch the device meta row is not read: a meta row of wrong offsets on the device
    changes nothing, and the bits equal those of the right row read on the device."""
    rng = np.random.default_rng(40 + rows)
    code, K, n_first, n_out = q.CODE_INT8, 32, 16, 21
    block, _, _, _ = matrix_block(rng, code, n_first + n_out, K)
    scale_at = block.size - 4 * (n_first + n_out)
    meta = matrix_meta(code, scale_at + 4 * n_first, n_first * K)  # k of a stacked block: nonzero offsets
    wrong = matrix_meta(code, scale_at)  # the first matrix's offsets
    x = cuda.to_device(rng.standard_normal((rows, K)).astype(np.float32))
    got = {}
    for name, device_meta, layout in (("read", meta, None), ("given", wrong, host_row(meta)), ("wrong", wrong, None)):
        out = cuda.to_device(np.full((rows, n_out), np.nan, np.float32))
        bounds = cuda.to_device(row_bounds(4))
        launch_linear_q8(x, cuda.to_device(block), cuda.to_device(device_meta), code, n_out, out, bounds, layout=layout)
        got[name] = out.copy_to_host()
    assert np.isfinite(got["given"]).all() and np.array_equal(got["given"], got["read"])
    assert not np.array_equal(got["wrong"], got["read"])  # the device row is what the kernel reads otherwise


def test_refusals():
    rng = np.random.default_rng(1)
    block, meta, _, _ = matrix_block(rng, q.CODE_INT8, 16, 32)
    args = dict(
        block=cuda.to_device(block),
        meta=cuda.to_device(meta),
        bounds=cuda.to_device(row_bounds(2)),
    )
    out = cuda.to_device(np.zeros((3, 16), np.float32))
    with pytest.raises(ValueError, match="bounds hold offsets for 1 to 2 rows"):
        launch_linear_q8(cuda.to_device(np.ones((3, 32), np.float32)), code=q.CODE_INT8, n_out=16, out=out, **args)
    with pytest.raises(ValueError, match="int8 .* or fp8"):
        launch_linear_q8(cuda.to_device(np.ones((1, 32), np.float32)), code=q.CODE_BF16, n_out=16, out=out[:1], **args)
    with pytest.raises(ValueError, match="multiple of 16"):
        launch_linear_q8(cuda.to_device(np.ones((1, 24), np.float32)), code=q.CODE_INT8, n_out=16, out=out[:1], **args)
    one = cuda.to_device(np.ones((1, 32), np.float32))
    fp8_row = host_row(matrix_meta(q.CODE_FP8, 64))
    with pytest.raises(ValueError, match=r"layout: its encoding \(3, 1\) is not the launch's only one"):
        launch_linear_q8(one, code=q.CODE_INT8, n_out=16, out=out[:1], layout=fp8_row, **args)
    with pytest.raises(ValueError, match="layout: a meta row of 8 values, got 3"):
        launch_linear_q8(one, code=q.CODE_INT8, n_out=16, out=out[:1], layout=(1, 1, 0), **args)
    with pytest.raises(TypeError, match="layout: a tuple of 8 ints"):
        launch_linear_q8(one, code=q.CODE_INT8, n_out=16, out=out[:1], layout=list(host_row(meta)), **args)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        matrix_meta(q.CODE_INT8, 66)
    with pytest.raises(ValueError, match="matrix offset 8: a matrix starts at a multiple of 16 bytes"):
        matrix_meta(q.CODE_INT8, 64, 8)
    with pytest.raises(ValueError, match="scales start past the matrix"):
        matrix_meta(q.CODE_INT8, 32, 32)


@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("rows", [1, 3])
def test_scales_read_late_give_the_same_bits(code, rows):
    """LaunchShape.late_scales reads each row's channel scale after its sums instead of before the stream: the same
    bits, one row (by slot) and a token tile, written and added into out."""
    rng = np.random.default_rng(7 * code + rows)
    n_out, K = 21, 64
    block, meta, _, _ = matrix_block(rng, code, n_out, K)
    x = cuda.to_device(rng.standard_normal((rows, K)).astype(np.float32))
    base = rng.standard_normal((rows, n_out)).astype(np.float32)
    bounds = cuda.to_device(row_bounds(4))
    args = (cuda.to_device(block), cuda.to_device(meta), code, n_out)
    for accumulate in (False, True):
        got = []
        for shape in (DECODE_SHAPE, DECODE_SHAPE._replace(late_scales=1)):
            out = cuda.to_device(base)
            launch_linear_q8(x, *args, out, bounds, accumulate=accumulate, shape=shape)
            got.append(out.copy_to_host())
        assert not np.array_equal(got[0], base) and np.array_equal(got[0], got[1]), (code, rows, accumulate)
