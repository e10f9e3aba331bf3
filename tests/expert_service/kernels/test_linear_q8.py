"""linear_q8 (a dense matrix on 8-bit rows with per-row scales: the 8-bit LM head) vs its numpy reference: one
row (by slot) and several (grouped, a partial token tile), int8 and fp8, a row count that is no multiple of a
block's rows (simulator on tiny shapes)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import expert_quant as q
from expert_service.kernels.linear_q8 import launch_linear_q8, linear_q8_reference, matrix_meta, row_bounds


def matrix_block(rng, code, n_out, K):
    """(uint8 block: codes then scales at a 64-byte-aligned offset, meta, codes [n_out, K], scales [n_out])."""
    w = rng.standard_normal((n_out, K)).astype(np.float32) * rng.uniform(0.05, 2.0, (n_out, 1)).astype(np.float32)
    raw, scale = q.quantize(w, code, q.SCALE_CHANNEL)
    scale_at = -(-raw.size // 64) * 64
    block = np.zeros(scale_at + scale.nbytes, np.uint8)
    block[: raw.size] = raw
    block[scale_at:] = scale.view(np.uint8)
    return block, matrix_meta(code, scale_at), raw.reshape(n_out, K), scale


@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_matches_reference(code, rows):
    rng = np.random.default_rng(100 * code + rows)
    n_out, K = 37, 48  # 37: the last row block is partial
    block, meta, codes, scale = matrix_block(rng, code, n_out, K)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    out = cuda.to_device(np.full((rows, n_out), np.nan, np.float32))  # every element must be written
    bounds = cuda.to_device(row_bounds(8))
    first = cuda.to_device(np.zeros((1, 1), np.int32))
    launch_linear_q8(cuda.to_device(x), cuda.to_device(block), cuda.to_device(meta), code, n_out, out, bounds, first)
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
    out = cuda.to_device(base)
    bounds, first = cuda.to_device(row_bounds(4)), cuda.to_device(np.zeros((1, 1), np.int32))
    args = (cuda.to_device(block), cuda.to_device(meta), code, n_out, out, bounds, first)
    launch_linear_q8(cuda.to_device(x), *args, accumulate=True)
    ref = base + linear_q8_reference(x, codes[n_first:], scale[n_first:], code)
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_refusals():
    rng = np.random.default_rng(1)
    block, meta, _, _ = matrix_block(rng, q.CODE_INT8, 16, 32)
    args = dict(
        block=cuda.to_device(block),
        meta=cuda.to_device(meta),
        bounds=cuda.to_device(row_bounds(2)),
        first_row=cuda.to_device(np.zeros((1, 1), np.int32)),
    )
    out = cuda.to_device(np.zeros((3, 16), np.float32))
    with pytest.raises(ValueError, match="bounds hold offsets for 1 to 2 rows"):
        launch_linear_q8(cuda.to_device(np.ones((3, 32), np.float32)), code=q.CODE_INT8, n_out=16, out=out, **args)
    with pytest.raises(ValueError, match="int8 .* or fp8"):
        launch_linear_q8(cuda.to_device(np.ones((1, 32), np.float32)), code=q.CODE_BF16, n_out=16, out=out[:1], **args)
    with pytest.raises(ValueError, match="multiple of 16"):
        launch_linear_q8(cuda.to_device(np.ones((1, 24), np.float32)), code=q.CODE_INT8, n_out=16, out=out[:1], **args)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        matrix_meta(q.CODE_INT8, 66)
    with pytest.raises(ValueError, match="matrix offset 8: a matrix starts at a multiple of 16 bytes"):
        matrix_meta(q.CODE_INT8, 64, 8)
    with pytest.raises(ValueError, match="scales start past the matrix"):
        matrix_meta(q.CODE_INT8, 32, 32)


@pytest.mark.parametrize("code", [q.CODE_INT8, q.CODE_FP8])
@pytest.mark.parametrize("accumulate", [False, True])
def test_one_row_split_over_warps_matches_reference(code, accumulate, monkeypatch):
    """A launch shape that splits a row group's K over 2 or 4 warps (moe_q8.split_for): every output written (13
    rows: the last group partial), the parts' sums met in shared memory, within float32 rounding of the reference
    and of the unsplit launch; the split the launch took is the one split_for names."""
    from expert_service.kernels import moe_q8

    rng = np.random.default_rng(7 + code + accumulate)
    n_out = 13
    from tests.expert_service.kernels.test_moe_q8 import built_kernels

    built = built_kernels(monkeypatch)
    for K, want_split in ((1024, 2), (2048 + 16, 4)):  # 2048 + 16: 129 chunks, parts of 64, 64, 1 and none
        block, meta, codes, scale = matrix_block(rng, code, n_out, K)
        shape = moe_q8.LaunchShape(4, 1, 2, 1, 4, split=4)
        assert moe_q8.split_for(shape, n_out, K, 1, False, 1) == want_split
        x = rng.standard_normal((1, K)).astype(np.float32)
        base = (
            rng.standard_normal((1, n_out)).astype(np.float32)
            if accumulate
            else np.full((1, n_out), np.nan, np.float32)
        )
        outs = []
        built.clear()
        for launch_shape in (moe_q8.LaunchShape(4, 1, 2, 1, 4), shape):
            out = cuda.to_device(base)
            bounds, first = cuda.to_device(row_bounds(2)), cuda.to_device(np.zeros((1, 1), np.int32))
            args = (cuda.to_device(block), cuda.to_device(meta), code, n_out, out, bounds, first)
            launch_linear_q8(cuda.to_device(x), *args, accumulate=accumulate, shape=launch_shape)
            outs.append(out.copy_to_host())
        assert [key[3].split for key in built] == [1, want_split]  # the launch split as split_for says
        ref = linear_q8_reference(x, codes, scale, code) + (base if accumulate else 0)
        assert np.isfinite(outs[1]).all()
        np.testing.assert_allclose(outs[1], ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_split_for_gives_warps_to_matrices_of_few_rows():
    """The engine's one-token 8-bit launches under a shape allowing 4 parts (4 warps a block, 2 gate / 4 down rows a
    warp, 2 chunks a lane in flight): the attention projections of the shapes benchmarked split, the experts' and
    the LM head's launches (enough warps already) and a shape allowing none do not."""
    from expert_service.kernels import moe_q8

    allowed = moe_q8.LaunchShape(4, 2, 4, 2, 16, split=4)
    assert moe_q8.split_for(allowed, 2048, 4096, 1, False, 1) == 4  # qwen3moe-shape o_proj: 512 warps -> 2,048
    assert moe_q8.split_for(allowed, 5120, 2048, 1, False, 1) == 2  # its q|k|v: 1,280 -> 2,560
    assert moe_q8.split_for(allowed, 4096, 4096, 1, False, 1) == 2  # mixtral-shape o_proj
    assert moe_q8.split_for(allowed, 768, 2048, 8, True, 1) == 1  # eight experts' gate|up: 3,072 warps
    assert moe_q8.split_for(allowed, 151936, 2048, 1, False, 1) == 1  # an LM head
    assert moe_q8.split_for(allowed, 2048, 1024, 1, False, 1) == 1  # 64 chunks a row: one step a warp already
    assert moe_q8.split_for(allowed._replace(split=1), 2048, 4096, 1, False, 1) == 1
    assert (
        moe_q8.split_for(moe_q8.LaunchShape(2, 2, 4, 2, 16, split=4), 2048, 4096, 1, False, 1) == 2
    )  # 2 warps a block


@pytest.mark.gpu
@pytest.mark.parametrize("n_out,K", [(2048, 4096), (5120, 2048), (4096, 4096)])
def test_split_rows_on_the_gpu(n_out, K):
    """The engine's split one-token launches at the benchmarked shapes' projection sizes (qwen3moe-shape o and
    q|k|v, mixtral-shape o), int8 and fp8, accumulating: within float32 rounding of the reference and the unsplit
    launch, relaunched with out reset each time (the same bits every time)."""
    from expert_service.kernels import moe_q8

    shape = moe_q8.DECODE_SHAPE._replace(split=4)
    assert moe_q8.split_for(shape, n_out, K, 1, False, 1) > 1
    for code in (q.CODE_INT8, q.CODE_FP8):
        rng = np.random.default_rng(n_out + K + code)
        block, meta, codes, scale = matrix_block(rng, code, n_out, K)
        x = rng.standard_normal((1, K)).astype(np.float32)
        base = rng.standard_normal((1, n_out)).astype(np.float32)
        args = [cuda.to_device(a) for a in (block, meta)] + [code, n_out]
        bounds, first = cuda.to_device(row_bounds(2)), cuda.to_device(np.zeros((1, 1), np.int32))
        dx, outs = cuda.to_device(x), []
        for launch_shape in (moe_q8.DECODE_SHAPE, shape, shape):
            out = cuda.to_device(base)
            launch_linear_q8(dx, *args, out, bounds, first, accumulate=True, shape=launch_shape)
            outs.append(out.copy_to_host())
        ref = base + linear_q8_reference(x, codes, scale, code)
        np.testing.assert_allclose(outs[1], ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert np.array_equal(outs[1], outs[2])
