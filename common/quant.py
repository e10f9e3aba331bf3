"""8-bit expert weights: quantisation (the converter) and exact dequantisation (the cpu reference).

Two dtypes and two scale schemes, the scale always a float32 *multiplier* (dequantised = q * scale):

    int8           symmetric, per output channel: scale [out] = max|row| / 127, q = round(w / scale)
    float8_e4m3fn  per output channel (scale [out] = max|row| / 448) or per 128x128 block
                   (scale [ceil(out/128), ceil(in/128)] = max|block| / 448, tail blocks partial), q = the
                   float32 -> e4m3 round-to-nearest-even of w / scale, saturated at +-448 (e4m3fn has no
                   infinity: an overflowing cast would give NaN)

fp8 bytes are stored raw (uint8); a 256-entry table decodes them, so the reference never depends on how a
library casts. All-zero rows/blocks get scale 1 (their q is 0 either way), rows too small for max / limit to be a
nonzero float32 the smallest one, a subnormal scale the float32 at or above max / limit; non-finite weights are
refused, as are scales above MAX_SCALE (a code times them would overflow float32).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from common.errors import ModelFormatError

INT8_MAX = 127.0
FP8_MAX = 448.0
BLOCK = 128
CHANNEL, BLOCK128 = "channel", "block128"
SCHEMES = (CHANNEL, BLOCK128)
SMALLEST_SCALE = np.float32(2.0**-149)  # the smallest positive float32 (a subnormal)
# The largest |code| a dtype's bytes can hold: int8's -128 too, though the quantizer writes -127..127.
CODE_MAGNITUDE = {"int8": 128.0, "float8_e4m3fn": FP8_MAX}


def _fp8_table() -> np.ndarray:
    """e4m3fn byte -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal,
    0x7F and 0xFF are NaN (there is no infinity)."""
    table = np.empty(256, dtype=np.float32)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[byte] = np.nan
        elif exponent == 0:
            table[byte] = sign * mantissa / 8.0 * 2.0**-6
        else:
            table[byte] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return table


FP8_TO_FLOAT32 = _fp8_table()


def scale_shape(scheme: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale tensor's shape for a matrix of `shape` [out, in]."""
    out, inner = shape
    if scheme == CHANNEL:
        return (out,)
    return (math.ceil(out / BLOCK), math.ceil(inner / BLOCK))


def expand_scale(scale: np.ndarray, scheme: str, shape: tuple[int, ...]) -> np.ndarray:
    """Scale [out] or [ceil(out/128), ceil(in/128)] -> a float32 array broadcastable against [out, in]."""
    if scheme == CHANNEL:
        return np.asarray(scale, dtype=np.float32)[:, None]
    # each block's scale over exactly its rows and columns (tail blocks partial): repeating every block 128 times
    # and cutting the result built a padded copy, twice the matrix for 129 rows
    rows, cols = (np.minimum(BLOCK, n - BLOCK * np.arange(math.ceil(n / BLOCK))) for n in shape)
    return np.repeat(np.repeat(np.asarray(scale, dtype=np.float32), rows, axis=0), cols, axis=1)


def _max_scale(dtype: str) -> np.float32:
    """The largest float32 scale whose product with every code of `dtype` is a finite float32: a larger one
    dequantises the row's largest codes to infinity."""
    code = np.float32(CODE_MAGNITUDE[dtype])
    scale = np.float32(float(np.finfo(np.float32).max) / float(code))
    with np.errstate(over="ignore"):
        while not np.isfinite(scale * code):
            scale = np.nextafter(scale, np.float32(0))
        while np.isfinite(np.nextafter(scale, np.float32(np.inf)) * code):
            scale = np.nextafter(scale, np.float32(np.inf))
    return scale


MAX_SCALE = {dtype: _max_scale(dtype) for dtype in CODE_MAGNITUDE}


def fp8_to_float32(raw: np.ndarray) -> np.ndarray:
    return FP8_TO_FLOAT32[np.asarray(raw).view(np.uint8)]


def dequantize(q: np.ndarray, scale: np.ndarray, dtype: str, scheme: str) -> np.ndarray:
    """Storage array q [out, in] (int8, or fp8 as uint8) and its scale -> float32 q * scale."""
    values = fp8_to_float32(q) if dtype == "float8_e4m3fn" else np.asarray(q, dtype=np.float32)
    return values * expand_scale(scale, scheme, q.shape)


def _amax(values: np.ndarray, scheme: str) -> np.ndarray:
    if scheme == CHANNEL:
        return np.abs(values).max(axis=1)
    out, inner = values.shape
    # the maximum of each run of 128 rows, then of 128 columns: tail blocks hold what is left, nothing padded
    row_blocks = np.maximum.reduceat(np.abs(values), np.arange(0, out, BLOCK), axis=0)
    return np.maximum.reduceat(row_blocks, np.arange(0, inner, BLOCK), axis=1)


def quantize(values: np.ndarray, dtype: str, scheme: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (storage array [out, in], float32 scale). int8 takes only per-channel scales."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "int8" and scheme != CHANNEL:
        raise ModelFormatError(f"tensor {name}: int8 experts take per-channel scales only, not {scheme}")
    if not np.isfinite(values).all():
        raise ModelFormatError(f"tensor {name}: non-finite weights cannot be quantized to {dtype}")
    limit = INT8_MAX if dtype == "int8" else FP8_MAX
    amax = _amax(values, scheme)
    # max / limit underflows to 0 for rows of subnormal weights: the smallest float32 still holds them (0 / 0
    # would make NaN codes).
    scale = np.where(amax > 0, np.maximum(amax / np.float32(limit), SMALLEST_SCALE), np.float32(1.0))
    scale = scale.astype(np.float32)
    # A subnormal max / limit rounds to a multiple of 2^-149, up to a third below the quotient: one float32
    # step up keeps the row's largest weights within the limit instead of saturating them.
    low = (scale < np.finfo(np.float32).tiny) & (amax / scale > limit)
    scale[low] = np.nextafter(scale[low], np.float32(np.inf))
    # any code times the scale must stay finite: int8 rows above 127/128 of float32's max cannot (-128 x max / 127)
    if (scale > MAX_SCALE[dtype]).any():
        peak = float(amax[scale > MAX_SCALE[dtype]].max())
        raise ModelFormatError(
            f"tensor {name}: weights up to {peak:g} are too large to quantize to {dtype} "
            f"(their scale times a code would overflow float32)"
        )
    scaled = values / expand_scale(scale, scheme, values.shape)
    # amax / limit rounds, so w / scale may land a hair past the limit: clip (saturate), never overflow.
    np.clip(scaled, -limit, limit, out=scaled)
    if dtype == "int8":
        return np.rint(scaled).astype(np.int8), scale
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale


def check_scale_values(scale: np.ndarray, dtype: str, name: str, file: str = "") -> None:
    """Refuses a scale holding NaN, an infinity, zero, a negative value or one above MAX_SCALE[dtype]: the
    converter never writes one, and as a multiplier it would turn the expert's output into NaN, infinity or
    garbage without any error."""
    bad = ~(np.isfinite(scale) & (scale > 0) & (scale <= MAX_SCALE[dtype]))
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ModelFormatError(
            f"{file + ': ' if file else ''}invalid scale in tensor {name}: {float(scale[index])} at {list(index)} "
            f"(scales are positive and finite, {dtype} ones at most {float(MAX_SCALE[dtype]):g}; corrupted?)"
        )
