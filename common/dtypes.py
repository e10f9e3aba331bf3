"""Storage dtypes of model weights and exact conversions between them.

bfloat16 has no numpy dtype: it is stored and handled as raw ``uint16`` words (the top half of a float32),
widened with a shift and narrowed with round-to-nearest-even, as the CUDA kernels do.
"""
from __future__ import annotations

import numpy as np

from common.errors import ModelFormatError

# name -> (numpy storage dtype, bytes per element)
STORAGE = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}
SAFETENSORS_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ALIASES = {"fp32": "float32", "f32": "float32", "float32": "float32", "fp16": "float16", "f16": "float16",
           "half": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
FP16_MAX = 65504.0


def canonical_dtype(name: str) -> str:
    try:
        return ALIASES[name.lower()]
    except KeyError:
        raise ModelFormatError(f"dtype {name!r} is not supported (supported: float32, float16, bfloat16)") from None


def itemsize(dtype: str) -> int:
    return STORAGE[dtype].itemsize


def bf16_to_float32(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even; NaN stays a quiet NaN (rounding could otherwise carry it into inf)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(values)
    return np.where(nan, (bits >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_to_float32(raw)
    return raw.astype(np.float32, copy=False)


def convert(raw: np.ndarray, src: str, dst: str, tensor_name: str) -> np.ndarray:
    """Storage array of dtype `src` -> storage array of dtype `dst`; refuses conversions that overflow."""
    if src == dst:
        return raw
    values = to_float32(raw, src)
    if dst == "float32":
        return values
    if dst == "bfloat16":
        return float32_to_bf16(values)
    finite = values[np.isfinite(values)]
    peak = float(np.abs(finite).max()) if finite.size else 0.0
    if peak > FP16_MAX:
        raise ModelFormatError(f"tensor {tensor_name}: converting {src} to float16 would overflow "
                               f"(|value| up to {peak:.6g} > {FP16_MAX:g}); use --dtype bfloat16 or float32")
    return values.astype(np.float16)
