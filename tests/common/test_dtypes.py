"""bfloat16 as raw uint16 words: the rounding, NaN and inf semantics the converter relies on; fp16 overflow
refusal."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from common import dtypes
from common.errors import ModelFormatError


def reference_bf16(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def test_bf16_ties_round_to_even():
    # Low half exactly 0x8000 is a tie: round up only when the kept word is odd.
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000], dtype=np.uint32)
    got = dtypes.float32_to_bf16(bits.view(np.float32))
    assert got.tolist() == [0x3F80, 0x3F82, 0x3F80, 0x3F81, 0xBF80, 0xBF82]
    assert np.array_equal(got, reference_bf16(bits.view(np.float32)))


def test_bf16_overflow_inf_and_subnormals():
    values = np.array(
        [np.finfo(np.float32).max, -np.finfo(np.float32).max, np.inf, -np.inf, 1e-40, -1e-45, 0.0, -0.0],
        dtype=np.float32,
    )
    assert np.array_equal(dtypes.float32_to_bf16(values), reference_bf16(values))
    assert dtypes.float32_to_bf16(values)[:4].tolist() == [0x7F80, 0xFF80, 0x7F80, 0xFF80]


def test_nan_stays_nan():
    # 0x7FFFFFFF would carry into the exponent (and read as inf) if NaN were rounded like a number.
    bits = np.array([0x7FC00000, 0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF, 0xFF800001], dtype=np.uint32)
    words = dtypes.float32_to_bf16(bits.view(np.float32))
    back = dtypes.bf16_to_float32(words)
    assert np.isnan(back).all()
    assert (words >> 15).tolist() == [0, 0, 0, 1, 1]  # the sign survives


def test_bf16_widening_is_exact_for_every_word():
    words = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ours = dtypes.bf16_to_float32(words)
    theirs = words.view(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))
    assert np.array_equal(dtypes.float32_to_bf16(ours[~nan]), words[~nan])  # narrowing undoes widening


def test_convert_between_storage_dtypes():
    values = np.random.default_rng(1).standard_normal((7, 9)).astype(np.float32) * 100
    bf16 = dtypes.convert(values, "float32", "bfloat16", "t")
    assert np.array_equal(bf16, reference_bf16(values))
    widened = bf16.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(dtypes.convert(bf16, "bfloat16", "float32", "t"), widened)
    assert np.array_equal(dtypes.convert(values, "float32", "float16", "t"), values.astype(np.float16))
    assert np.array_equal(dtypes.convert(bf16, "bfloat16", "float16", "t"), widened.astype(np.float16))
    assert dtypes.convert(values, "float32", "float32", "t") is values


@pytest.mark.parametrize("src", ["float32", "bfloat16"])
def test_fp16_overflow_is_refused_with_the_tensor_named(src):
    values = np.array([1.0, -7.0e4, 3.0], dtype=np.float32)
    raw = values if src == "float32" else reference_bf16(values)
    with pytest.raises(ModelFormatError, match=r"tensor layers\.3\.o_proj: converting .* would overflow"):
        dtypes.convert(raw, src, "float16", "layers.3.o_proj")


def test_bf16_overflow_is_refused_with_the_tensor_named():
    """float32 values near float32's max round to bfloat16's infinity: the fp16 conversion refused its overflow,
    the bf16 one wrote inf for a finite weight. The largest bf16 value and real infinities still pass."""
    values = np.array([1.0, -3.4e38, 3.0], dtype=np.float32)
    with pytest.raises(
        ModelFormatError, match=r"^tensor layers\.3\.o_proj: converting float32 to bfloat16 would overflow"
    ):
        dtypes.convert(values, "float32", "bfloat16", "layers.3.o_proj")
    largest = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    passing = np.array([largest, -largest, np.inf, -np.inf, np.nan], dtype=np.float32)
    assert np.array_equal(dtypes.convert(passing, "float32", "bfloat16", "t"), reference_bf16(passing))


def test_fp16_limit_and_non_finite_values_pass():
    values = np.array([65504.0, -65504.0, np.inf, np.nan], dtype=np.float32)
    out = dtypes.convert(values, "float32", "float16", "t")
    assert out[:3].tolist() == [65504.0, -65504.0, np.inf] and np.isnan(out[3])


def test_canonical_dtype():
    assert [dtypes.canonical_dtype(n) for n in ("BF16", "fp16", "f32", "half")] == [
        "bfloat16",
        "float16",
        "float32",
        "float16",
    ]
    with pytest.raises(ModelFormatError, match="'int8' is not supported"):
        dtypes.canonical_dtype("int8")
