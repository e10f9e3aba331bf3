"""Per-row activation quantization (int8, fp8 e4m3) against its numpy reference (common.quant with per-channel
scales on the rows), bit for bit: gathered float32 rows through moe_align's order (padding rows zeros, scale 1),
bf16 rows, values across every e4m3 range (subnormals, ties, the saturation edge), all-zero rows, and non-finite
rows (NaN scale). Outputs start as 0xAB / NaN so an unwritten element shows; rows past num_tiles * BM stay so."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.expert_quant import CODE_FP8, CODE_INT8
from expert_service.kernels.moe_align import launch_moe_align, max_tiles
from expert_service.kernels.moe_gemm_mma import bf16_round
from expert_service.kernels.quantize_rows import (
    launch_quantize_gathered,
    launch_quantize_rows,
    quantize_rows_reference,
)
from tests.helpers import random_ids

CODES = (CODE_INT8, CODE_FP8)


def spread_rows(rng, rows, width):
    """Rows whose magnitudes span ~2^-12 .. 2^4 relative to their max, so fp8's subnormals and ties occur."""
    values = rng.standard_normal((rows, width)).astype(np.float32)
    values *= (2.0 ** rng.uniform(-12, 4, (rows, width))).astype(np.float32)
    return values


@pytest.mark.parametrize("code", CODES)
def test_gathered_rows_match_reference(code):
    rng = np.random.default_rng(code)
    n_tok, top_k, n_exp, D, bm = 37, 2, 5, 136, 16
    ids = random_ids(rng, n_tok, top_k, n_exp)
    x = spread_rows(rng, n_tok, D)
    x[3] = 0.0  # an all-zero token: scale 1, codes 0
    tiles = max_tiles(ids.size, n_exp, bm)
    rows = tiles * bm
    sorted_ids, tile_expert, num_tiles, position = (
        cuda.to_device(np.full(s, -7, np.int32)) for s in (rows, tiles, 1, ids.size)
    )
    launch_moe_align(cuda.to_device(ids), n_exp, bm, sorted_ids, tile_expert, num_tiles, position)
    q = cuda.to_device(np.full((rows, D), 0xAB, np.uint8))
    scales = cuda.to_device(np.full(rows, np.nan, np.float32))
    launch_quantize_gathered(cuda.to_device(x), sorted_ids, num_tiles, top_k, bm, code, q, scales)
    used = int(num_tiles.copy_to_host()[0]) * bm
    order = sorted_ids.copy_to_host()[:used]
    got_q, got_s = q.copy_to_host(), scales.copy_to_host()
    padding = order < 0
    assert (got_q[:used][padding] == 0).all() and (got_s[:used][padding] == 1.0).all()
    ref_q, ref_s = quantize_rows_reference(x[order[~padding] // top_k], code)
    np.testing.assert_array_equal(got_s[:used][~padding], ref_s)
    np.testing.assert_array_equal(got_q[:used][~padding], ref_q)
    assert (got_q[used:] == 0xAB).all() and np.isnan(got_s[used:]).all(), "rows past the used tiles were written"
    zero_rows = order[~padding] // top_k == 3
    assert zero_rows.any() and (got_s[:used][~padding][zero_rows] == 1.0).all()


@pytest.mark.parametrize("code", CODES)
def test_bf16_rows_match_reference(code):
    rng = np.random.default_rng(10 + code)
    rows, width, bm = 32, 200, 16
    h = bf16_round(spread_rows(rng, rows, width))
    h[5] = 0.0
    bits = (h.view(np.uint32) >> 16).astype(np.uint16)
    q = cuda.to_device(np.full((rows, width), 0xAB, np.uint8))
    scales = cuda.to_device(np.full(rows, np.nan, np.float32))
    num_tiles = cuda.to_device(np.array([1], np.int32))  # one tile of 16: the second half stays unwritten
    launch_quantize_rows(cuda.to_device(bits), num_tiles, bm, code, q, scales)
    ref_q, ref_s = quantize_rows_reference(h[:bm], code)
    np.testing.assert_array_equal(scales.copy_to_host()[:bm], ref_s)
    np.testing.assert_array_equal(q.copy_to_host()[:bm], ref_q)
    assert (q.copy_to_host()[bm:] == 0xAB).all()


def test_fp8_codes_cover_every_range():
    """One row holding 448 (its scale 1) and values at e4m3's ties, subnormals and the top of the range."""
    codes = np.arange(256, dtype=np.uint8)
    finite = codes[np.isfinite(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))]
    exact = finite.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ordered = np.sort(exact[exact >= 0])
    midpoints = (ordered[1:] + ordered[:-1]) / 2  # ties: nearest even decides
    row = np.concatenate([[448.0], exact, midpoints, -midpoints, [447.9, 440.0, 2.0**-10, -(2.0**-10)]])
    row = np.resize(row.astype(np.float32), -(-row.size // 4) * 4)
    x = row[None, :].copy()
    sorted_ids, one = cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(np.array([1], np.int32))
    q = cuda.to_device(np.full(x.shape, 0xAB, np.uint8))
    scales = cuda.to_device(np.full(1, np.nan, np.float32))
    launch_quantize_gathered(cuda.to_device(x), sorted_ids, one, 1, 1, CODE_FP8, q, scales)
    ref_q, ref_s = quantize_rows_reference(x, CODE_FP8)
    assert ref_s[0] == 1.0
    np.testing.assert_array_equal(q.copy_to_host(), ref_q)


@pytest.mark.parametrize("code", CODES)
def test_rows_of_subnormals_match_reference_without_nan_codes(code):
    """max|row| / 127 (or / 448) underflows to 0 for rows of subnormals: the scale is then the smallest float32,
    as in common.quant, never 0 (0 / 0 would be a NaN code and the row lost)."""
    rng = np.random.default_rng(20 + code)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    x[1:5] = rng.integers(-60, 61, size=(4, 40)).astype(np.float32) * np.float32(2.0**-149)
    x[2, 0] = 0.0
    sorted_ids = cuda.to_device(np.arange(6, dtype=np.int32))
    one = cuda.to_device(np.array([1], np.int32))
    q = cuda.to_device(np.full(x.shape, 0xAB, np.uint8))
    scales = cuda.to_device(np.full(6, np.nan, np.float32))
    launch_quantize_gathered(cuda.to_device(x), sorted_ids, one, 1, 6, code, q, scales)
    ref_q, ref_s = quantize_rows_reference(x, code)
    got_q, got_s = q.copy_to_host(), scales.copy_to_host()
    assert (got_s > 0).all() and np.isfinite(got_s).all()
    np.testing.assert_array_equal(got_s, ref_s)
    np.testing.assert_array_equal(got_q, ref_q)
    if code == CODE_FP8:
        assert not np.any((got_q & 0x7F) == 0x7F)


@pytest.mark.parametrize("code", CODES)
def test_rows_whose_scale_is_subnormal_step_it_up_as_the_reference(code):
    """max|row| / limit between the smallest float32 and the smallest normal one rounds down by up to a third (a
    multiple of 2^-149): common.quant steps such a scale up once so the largest values stay within the limit; the
    kernel did not, so its codes and scales differed from the reference it is held to bit for bit."""
    rng = np.random.default_rng(40 + code)
    x = rng.integers(-30_000, 30_001, size=(8, 40)).astype(np.float32) * np.float32(2.0**-149)
    x[:, 0] = np.float32(2.0**-149) * np.array([300, 301, 427, 1000, 4001, 12_345, 29_999, 30_000], np.float32)
    ref_q, ref_s = quantize_rows_reference(x, code)
    assert (ref_s < np.finfo(np.float32).tiny).all()  # every row's scale is subnormal here
    sorted_ids = cuda.to_device(np.arange(8, dtype=np.int32))
    one = cuda.to_device(np.array([1], np.int32))
    q = cuda.to_device(np.full(x.shape, 0xAB, np.uint8))
    scales = cuda.to_device(np.full(8, np.nan, np.float32))
    launch_quantize_gathered(cuda.to_device(x), sorted_ids, one, 1, 8, code, q, scales)
    np.testing.assert_array_equal(scales.copy_to_host(), ref_s)
    np.testing.assert_array_equal(q.copy_to_host(), ref_q)


@pytest.mark.parametrize("code", CODES)
def test_non_finite_row_gets_nan_scale(code):
    x = np.ones((2, 8), np.float32)
    x[1, 3] = np.inf
    sorted_ids = cuda.to_device(np.array([0, 1], np.int32))
    one = cuda.to_device(np.array([1], np.int32))
    q = cuda.to_device(np.zeros((2, 8), np.uint8))
    scales = cuda.to_device(np.zeros(2, np.float32))
    launch_quantize_gathered(cuda.to_device(x), sorted_ids, one, 1, 2, code, q, scales)
    got = scales.copy_to_host()
    assert np.isfinite(got[0]) and np.isnan(got[1])


def test_rejects_bad_arguments():
    ids, one = cuda.to_device(np.zeros(2, np.int32)), cuda.to_device(np.array([1], np.int32))

    def launch(width, code, q_dtype):
        x = cuda.to_device(np.zeros((2, width), np.float32))
        q = cuda.to_device(np.zeros((2, width), q_dtype))
        launch_quantize_gathered(x, ids, one, 1, 2, code, q, cuda.to_device(np.zeros(2, np.float32)))

    with pytest.raises(ValueError, match="multiple of 4"):
        launch(6, CODE_INT8, np.uint8)
    with pytest.raises(ValueError, match="neither int8"):
        launch(8, 0, np.uint8)
    with pytest.raises(ValueError, match="uint8"):
        launch(8, CODE_FP8, np.int8)
