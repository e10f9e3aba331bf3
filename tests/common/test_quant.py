"""8-bit quantisation and its exact dequantisation (common/quant.py)."""

from __future__ import annotations

import re
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from common import quant
from common.errors import ModelFormatError


def test_fp8_table_decodes_every_byte_as_ml_dtypes_does():
    raw = np.arange(256, dtype=np.uint8)
    theirs = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ours = quant.fp8_to_float32(raw)
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan) and nan.sum() == 2 and nan[0x7F] and nan[0xFF]
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert ours[0x38] == 1 and ours[0x7E] == 448 and ours[0xFE] == -448 and ours[1] == 2.0**-9


@pytest.mark.parametrize(
    "dtype, scheme", [("int8", quant.CHANNEL), ("float8_e4m3fn", quant.CHANNEL), ("float8_e4m3fn", quant.BLOCK128)]
)
@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (130, 129), (257, 64)])
def test_round_trip_error_is_within_half_a_step(dtype, scheme, shape):
    rng = np.random.default_rng(sum(shape))
    values = (rng.standard_normal(shape) * rng.uniform(0.01, 10, size=(shape[0], 1))).astype(np.float32)
    values[0, 0] = 50.0  # an outlier: per-block scales keep the rest of the matrix fine
    q, scale = quant.quantize(values, dtype, scheme, "w")
    assert q.shape == shape and scale.shape == quant.scale_shape(scheme, shape) and scale.dtype == np.float32
    back = quant.dequantize(q, scale, dtype, scheme)
    assert back.dtype == np.float32 and np.isfinite(back).all()
    step = quant.expand_scale(scale, scheme, shape)  # one unit of q, per element
    if dtype == "int8":
        assert np.all(np.abs(back - values) <= 0.5 * step * (1 + 1e-6))
        assert np.abs(q).max() == 127 and q.min() >= -127
    else:  # e4m3: 3 mantissa bits -> relative half-step 2^-4 of the value; subnormals: 2^-10 of the scale
        bound = np.maximum(np.abs(values) * 2.0**-4, step * 2.0**-10) * (1 + 1e-6)
        assert np.all(np.abs(back - values) <= bound)
        assert np.abs(quant.fp8_to_float32(q)).max() == 448


def test_row_maxima_saturate_at_448_and_never_become_nan_bytes():
    """amax / 448 rounds to float32, so w / scale can land a hair above 448, where e4m3fn's next pattern
    is NaN: the quantizer clips. Many random maxima exercise both rounding directions."""
    rng = np.random.default_rng(3)
    values = rng.uniform(-1, 1, size=(4096, 3)).astype(np.float32)
    values[:, 0] = rng.uniform(1, 1e6, size=4096).astype(np.float32) * rng.choice([-1, 1], size=4096)
    for scheme in (quant.CHANNEL, quant.BLOCK128):
        q, _ = quant.quantize(values, "float8_e4m3fn", scheme, "w")
        assert not np.any((q & 0x7F) == 0x7F)
    q, _ = quant.quantize(values, "float8_e4m3fn", quant.CHANNEL, "w")
    assert np.array_equal(np.abs(quant.fp8_to_float32(q[:, 0])), np.full(4096, 448, np.float32))


def test_zero_rows_and_blocks_get_unit_scales():
    values = np.zeros((3, 200), dtype=np.float32)
    values[1, 150] = 2.0
    q, scale = quant.quantize(values, "int8", quant.CHANNEL, "w")
    assert scale.tolist() == [1.0, pytest.approx(2 / 127), 1.0] and q[0].max() == q[2].max() == 0
    q, scale = quant.quantize(values, "float8_e4m3fn", quant.BLOCK128, "w")
    assert scale.tolist() == [[1.0, pytest.approx(2 / 448)]]
    assert np.array_equal(quant.dequantize(q, scale, "float8_e4m3fn", quant.BLOCK128), values)


def test_tail_blocks_take_the_scale_of_their_own_values():
    values = np.ones((130, 131), dtype=np.float32)
    values[128:, 128:] = 0.25  # the corner tail block alone
    _, scale = quant.quantize(values, "float8_e4m3fn", quant.BLOCK128, "w")
    assert scale.shape == (2, 2) and scale[1, 1] == np.float32(0.25 / 448) and scale[0, 0] == np.float32(1 / 448)


@pytest.mark.parametrize("shape", [(129, 2048), (2048, 129), (1024, 512)])
def test_partial_blocks_cost_no_padded_copy(shape):
    """Block maxima and expanded block scales were built on a copy padded to whole 128x128 blocks: 129 rows held
    256, so quantizing took 11.9 bytes per element (8 at whole blocks) and dequantising 16 (12), past the memory
    bound the converter promises. The bytes a matrix costs no longer depend on its tail blocks."""
    values = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    q, scale = quant.quantize(values, "float8_e4m3fn", quant.BLOCK128, "w")
    peaks = []
    for step in (
        lambda: quant.quantize(values, "float8_e4m3fn", quant.BLOCK128, "w"),
        lambda: quant.dequantize(q, scale, "float8_e4m3fn", quant.BLOCK128),
    ):
        tracemalloc.start()
        try:
            step()
            peaks.append(tracemalloc.get_traced_memory()[1] / values.size)
        finally:
            tracemalloc.stop()
    assert peaks[0] <= 8.5 and peaks[1] <= 12.5, peaks


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(bad):
    values = np.ones((2, 2), dtype=np.float32)
    values[1, 1] = bad
    with pytest.raises(ModelFormatError, match=r"^tensor layers\.0\.experts\.1\.up_proj: non-finite"):
        quant.quantize(values, "int8", quant.CHANNEL, "layers.0.experts.1.up_proj")


def test_weights_whose_int8_codes_would_dequantise_to_infinity_are_refused():
    """A row whose maximum is float32's largest value got the scale max / 127 rounded up, and 127 x that scale is
    infinity: the model served inf for a finite weight. fp8's max / 448 fits, so it quantizes that row."""
    values = np.ones((2, 3), dtype=np.float32)
    values[1, 0] = np.finfo(np.float32).max
    with pytest.raises(
        ModelFormatError, match=r"^tensor w: weights up to 3\.40282e\+38 are too large to quantize to int8"
    ):
        quant.quantize(values, "int8", quant.CHANNEL, "w")
    for scheme in quant.SCHEMES:
        q, scale = quant.quantize(values, "float8_e4m3fn", scheme, "w")
        assert np.isfinite(quant.dequantize(q, scale, "float8_e4m3fn", scheme)).all()
    q, scale = quant.quantize(values * np.float32(0.99), "int8", quant.CHANNEL, "w")  # below the bound: as before
    assert np.isfinite(quant.dequantize(q, scale, "int8", quant.CHANNEL)).all() and q[1, 0] == 127


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_the_largest_scale_times_every_code_is_finite(dtype):
    codes = np.arange(256, dtype=np.uint8) if dtype == "float8_e4m3fn" else np.arange(-128, 128, dtype=np.int8)
    codes = codes[None, :] if dtype == "int8" else codes[None, (codes & 0x7F) != 0x7F]
    largest = np.array([quant.MAX_SCALE[dtype]], np.float32)
    assert np.isfinite(quant.dequantize(codes, largest, dtype, quant.CHANNEL)).all()
    with np.errstate(over="ignore"):
        above = np.nextafter(largest, np.float32(np.inf))
        assert not np.isfinite(quant.dequantize(codes, above, dtype, quant.CHANNEL)).all()
    with pytest.raises(
        ModelFormatError, match=rf"invalid scale in tensor s: {re.escape(str(float(above[0])))} at \[0\] "
    ):
        quant.check_scale_values(above, dtype, "s")
    quant.check_scale_values(largest, dtype, "s")


def test_int8_takes_per_channel_scales_only():
    with pytest.raises(ModelFormatError, match="per-channel"):
        quant.quantize(np.ones((2, 2), np.float32), "int8", quant.BLOCK128, "w")


@pytest.mark.parametrize(
    "dtype, scheme", [("int8", quant.CHANNEL), ("float8_e4m3fn", quant.CHANNEL), ("float8_e4m3fn", quant.BLOCK128)]
)
def test_rows_too_small_for_a_normal_scale_keep_their_values_and_never_get_nan_bytes(dtype, scheme):
    """max|row| / 127 (or / 448) underflows float32 to 0 for rows of subnormal weights: a zero scale would divide
    0 by 0 into NaN codes (an e4m3fn NaN byte, an undefined int8) and lose the row. Rows of normal weights sit
    between them so the scales of other rows and blocks are seen to stay as before."""
    rng = np.random.default_rng(11)
    tiny = np.float32(2.0**-149)  # the smallest positive float32
    values = (rng.standard_normal((260, 140)) * rng.uniform(0.1, 4, size=(260, 1))).astype(np.float32)
    tiny_rows = rng.choice(260, size=40, replace=False)
    # subnormal multiples of `tiny`, at most 60 units: max / 127 and max / 448 round to a zero float32
    values[tiny_rows] = rng.integers(-60, 61, size=(40, 140)).astype(np.float32) * tiny
    values[tiny_rows[:5]] = 0.0  # all-zero rows too
    if scheme == quant.BLOCK128:
        values[:128, :128] = rng.integers(-60, 61, size=(128, 128)).astype(np.float32) * tiny  # a tiny block
    q, scale = quant.quantize(values, dtype, scheme, "w")
    assert np.isfinite(scale).all() and (scale > 0).all()
    if dtype == "float8_e4m3fn":
        assert not np.any((q & 0x7F) == 0x7F)
    else:
        assert q.min() >= -127
    back = quant.dequantize(q, scale, dtype, scheme)
    step = np.broadcast_to(quant.expand_scale(scale, scheme, values.shape), values.shape)
    small = np.zeros(values.shape, dtype=bool)  # the elements whose scale is the smallest float32
    if scheme == quant.BLOCK128:
        small[:128, :128] = True
    else:
        row_max = np.abs(values).max(axis=1)
        small[(row_max > 0) & (row_max <= 60 * tiny)] = True
    assert np.all(step[small] == tiny) and small.sum() >= 35 * 128
    if dtype == "int8":  # a scale of one unit holds integer multiples of it exactly
        assert np.array_equal(back[small], values[small])
        assert np.all(np.abs(back - values) <= 0.5 * step * (1 + 1e-6))
    else:
        bound = np.maximum(np.abs(values) * 2.0**-4, step * 2.0**-10) * (1 + 1e-6)
        assert np.all(np.abs(back - values) <= bound)


@pytest.mark.parametrize(
    "dtype, scheme", [("int8", quant.CHANNEL), ("float8_e4m3fn", quant.CHANNEL), ("float8_e4m3fn", quant.BLOCK128)]
)
def test_rows_whose_scale_is_subnormal_never_saturate(dtype, scheme):
    """max / limit in float32's subnormal range rounds to a multiple of 2^-149, up to a third below the exact
    quotient: the row's largest weights then divided past the limit and were clipped (a third of their value
    lost, with no error). Each row here has its own maximum, between 61 and ~100,000 units of 2^-149."""
    tiny = np.float32(2.0**-149)
    units = np.arange(61, 100_000, 97)
    values = np.zeros((units.size, 3), np.float32)
    values[:, 0] = units * tiny
    values[:, 1] = -(units // 2) * tiny
    values[:, 2] = (units // 3) * tiny
    values_per_row = values
    if scheme == quant.BLOCK128:  # one nonzero row per block: each block's maximum is its row's
        values = np.zeros((units.size * 128, 3), np.float32)
        values[::128] = values_per_row
    q, scale = quant.quantize(values, dtype, scheme, "w")
    back = quant.dequantize(q, scale, dtype, scheme)
    step = np.broadcast_to(quant.expand_scale(scale, scheme, values.shape), values.shape)
    if dtype == "int8":
        bound = 0.5 * step * (1 + 1e-6)
    else:
        bound = np.maximum(np.abs(values) * 2.0**-4, step * 2.0**-10) * (1 + 1e-6)
    worst = int(np.argmax(np.abs(back - values) - bound))
    assert np.all(np.abs(back - values) <= bound), (values.flat[worst], back.flat[worst])
