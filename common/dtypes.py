"""Storage dtypes of model weights and exact conversions between them.

bfloat16 is stored and handled as raw ``uint16`` words (the top half of a float32), the form the CUDA kernels
read; ``ml_dtypes.bfloat16`` converts them: widening is exact, narrowing rounds to nearest even (as the kernels
do) and keeps a NaN a NaN. The 8-bit expert dtypes (``int8``, ``float8_e4m3fn`` stored as raw ``uint8``
bytes) only ever hold routed experts' matrices, with float32 scales beside them (``common/quant.py``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from common.errors import ModelFormatError

# name -> (numpy storage dtype, bytes per element)
STORAGE: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "int8": np.dtype(np.int8),
    "float8_e4m3fn": np.dtype(np.uint8),
}
DENSE_DTYPES = ("float32", "float16", "bfloat16")
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")
SAFETENSORS_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}
# What `--expert-dtype` and an expert dtype file accept: the dense names plus the 8-bit ones.
EXPERT_ALIASES = {**ALIASES, "int8": "int8", "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn"}
EXPERT_ALIASES["float8_e4m3fn"] = "float8_e4m3fn"
FP16_MAX = 65504.0


def canonical_dtype(name: str) -> str:
    try:
        return ALIASES[name.lower()]
    except KeyError:
        raise ModelFormatError(f"dtype {name!r} is not supported (supported: float32, float16, bfloat16)") from None


def canonical_expert_dtype(name: object, where: str = "--expert-dtype") -> str:
    """An expert dtype name or alias -> its canonical name; one-line error naming `where` otherwise."""
    canonical = EXPERT_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if canonical is None:
        raise ModelFormatError(
            f"{where}: expert dtype {name!r} is not supported "
            f"(supported: {', '.join(DENSE_DTYPES + QUANTIZED_DTYPES)}; aliases bf16, fp16, fp32, fp8)"
        )
    return canonical


def itemsize(dtype: str) -> int:
    return STORAGE[dtype].itemsize


def bf16_to_float32(words: np.ndarray) -> np.ndarray:
    return np.asarray(words, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even; a NaN stays a NaN (bit rounding could carry it into inf)."""
    with np.errstate(invalid="ignore"):  # a NaN input is not an error here: it converts to a NaN
        return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


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
        words = float32_to_bf16(values)
        # float32 values from 2^128 x (1 - 2^-9) up round to bfloat16's infinity: more infinities than went in
        if np.count_nonzero((words & 0x7FFF) == 0x7F80) != np.count_nonzero(np.isinf(values)):
            peak = float(np.abs(values[np.isfinite(values)]).max())
            raise ModelFormatError(
                f"tensor {tensor_name}: converting {src} to bfloat16 would overflow "
                f"(|value| up to {peak:.6g} rounds to infinity); use --dtype float32"
            )
        return words
    finite = values[np.isfinite(values)]
    peak = float(np.abs(finite).max()) if finite.size else 0.0
    if peak > FP16_MAX:
        raise ModelFormatError(
            f"tensor {tensor_name}: converting {src} to float16 would overflow "
            f"(|value| up to {peak:.6g} > {FP16_MAX:g}); use --dtype bfloat16 or float32"
        )
    return values.astype(np.float16)


def first_fp8_nan(raw: np.ndarray) -> int | None:
    """The flat index of the first float8_e4m3fn NaN byte (0x7f or 0xff) in the uint8 array `raw`, else None. Two
    max reductions decide, with no temporary (0xff is the largest uint8, 0x7f the largest int8): 9 GB/s on one core,
    against zlib.crc32's 1.4; the index is searched only when there is one."""
    if raw.size == 0 or (raw.max() != 0xFF and raw.view(np.int8).max() != 0x7F):
        return None
    return int(np.flatnonzero((raw & 0x7F) == 0x7F)[0])
