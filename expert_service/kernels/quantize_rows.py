"""Per-row dynamic quantization of activations to 8 bits (int8 or fp8 e4m3), the A operand of the W8A8 grouped GEMM
(`moe_gemm_w8a8`): each row gets its own scale, max|row| / 127 (int8) or / 448 (fp8) but at least the smallest
float32, 1 for an all-zero row, and q = round(v / scale) saturated to the type's range -- `common.quant.quantize`
with per-channel scales applied to the rows, which is this kernel's numpy reference (`quantize_rows_reference`).

Two sources, one launch each, grid (rows,) of QUANT_THREADS:
- gathered: x [T, D] float32 through moe_align's sorted_ids (row r is token sorted_ids[r] // K; padding rows, -1,
  get q = 0 and scale 1), so the expert inputs are quantized straight from float32 without a bf16 copy;
- rows: h [rows, F] bf16 (the gate|up kernel's SwiGLU output, zeros in padding rows) row by row.
Rows at or past num_tiles * block_m are not touched (the GEMMs skip their tiles). A row holding a NaN or an infinity
gets a NaN scale, so whatever reads it is NaN too (never silently finite).

Rounding: int8 to nearest even (rint), fp8 to nearest even of e4m3fn (subnormals from 2^-9, max 448, no NaN code is
ever produced), both by float32 arithmetic and bit operations, so the simulator runs the same code.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from common import quant as common_quant
from common.dtypes import bf16_to_float32, float32_to_bf16
from expert_service.kernels.expert_quant import CODE_FP8, CODE_INT8, decode
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import WARP, bf16_to_f32, f32_as_u32, u32_as_f32, warp_max

QUANT_THREADS = 256
_WARPS = QUANT_THREADS // 32  # a literal for the shared-array shape
INT8_MAX, FP8_MAX = common_quant.INT8_MAX, common_quant.FP8_MAX
# Adding and subtracting 1.5 * 2^23 rounds a float32 of magnitude below 2^22 to an integer, ties to even.
_RNE_MAGIC = np.float32(12582912.0)
_FP8_MIN_NORMAL = np.float32(2.0 ** -6)
_SMALLEST_SCALE = common_quant.SMALLEST_SCALE
_TINY = np.float32(np.finfo(np.float32).tiny)  # the smallest normal float32: scales below it are subnormal
DTYPES = {CODE_INT8: "int8", CODE_FP8: "float8_e4m3fn"}  # common.quant's names


@cuda.jit(device=True, inline=True)
def int8_byte(v):
    """v (already divided by the scale) -> its int8 code as the low byte of a uint32: clip to +-127, rint."""
    c = min(max(v, np.float32(-INT8_MAX)), np.float32(INT8_MAX)) if v == v else np.float32(0.0)  # NaN: scale is NaN
    r = (c + _RNE_MAGIC) - _RNE_MAGIC
    return np.uint32(np.int32(r)) & np.uint32(0xFF)


@cuda.jit(device=True, inline=True)
def fp8_byte(v):
    """v (already divided by the scale) -> its e4m3fn code (uint32, low byte): saturate at 448, nearest even."""
    u32 = np.uint32
    sign = (f32_as_u32(v) >> u32(24)) & u32(0x80)
    a = min(abs(v), np.float32(FP8_MAX))
    if a < _FP8_MIN_NORMAL:  # subnormal steps of 2^-9 (8 of them reach 2^-6: code 0x08, the smallest normal)
        m = (a * np.float32(512.0) + _RNE_MAGIC) - _RNE_MAGIC
        return sign | u32(m)
    b = f32_as_u32(a)
    b = u32(u32(b + u32(0x7FFFF)) + ((b >> u32(20)) & u32(1)))  # round the mantissa to 3 bits, ties to even
    # (the mask keeps a NaN's code, whose row scale is NaN anyway, inside its byte)
    return sign | (u32(u32((b >> u32(23)) - u32(120)) << u32(3)) & u32(0x78)) | ((b >> u32(20)) & u32(7))


@cuda.jit(device=True, inline=True)
def _block_max(value):
    """max over the block (QUANT_THREADS threads) of non-negative values, NaN if any thread holds NaN."""
    partial = cuda.shared.array(_WARPS, dtype=np.float32)
    bad = cuda.shared.array(1, dtype=np.int32)
    if cuda.threadIdx.x == 0:
        bad[0] = 0
    cuda.syncthreads()
    if value != value:
        bad[0] = 1
    total = warp_max(value)
    if cuda.threadIdx.x % WARP == 0:
        partial[cuda.threadIdx.x // WARP] = total
    cuda.syncthreads()
    total = np.float32(0.0)
    for i in range(_WARPS):
        total = max(total, partial[i])
    if bad[0] != 0:
        total = np.float32(np.nan)
    cuda.syncthreads()
    return total


@functools.cache
def _build(gathered: bool, code: int):
    """The kernel for one source (gathered float32 rows, or bf16 rows) and one 8-bit code."""
    limit = np.float32(INT8_MAX if code == CODE_INT8 else FP8_MAX)
    to_byte = int8_byte if code == CODE_INT8 else fp8_byte

    @cuda.jit(device=True, inline=True)
    def load4(src, row, j):
        """Values 4j .. 4j + 3 of the source row as float32."""
        if gathered:
            return src[row, 4 * j], src[row, 4 * j + 1], src[row, 4 * j + 2], src[row, 4 * j + 3]
        lo, hi = src[row, 2 * j], src[row, 2 * j + 1]
        return (bf16_to_f32(lo & np.uint32(0xFFFF)), bf16_to_f32(lo >> np.uint32(16)),
                bf16_to_f32(hi & np.uint32(0xFFFF)), bf16_to_f32(hi >> np.uint32(16)))

    def quantize_rows_kernel(src, sorted_ids, num_tiles, top_k, block_m, q4, scales):
        """src: x [T, D] float32 (gathered) or h [rows, F / 2] uint32 (bf16 pairs); sorted_ids [rows] int32 (gathered
        only), num_tiles [1]; q4 [rows, width / 4] uint32 (4 codes a word, the first in the low byte), scales [rows]
        float32. Grid (rows,), block (QUANT_THREADS,)."""
        r = cuda.blockIdx.x
        if r >= num_tiles[0] * block_m:
            return
        words = q4.shape[1]
        row = r
        if gathered:
            a = sorted_ids[r]
            if a < 0:  # padding: zeros, scale 1
                for j in range(cuda.threadIdx.x, words, QUANT_THREADS):
                    q4[r, j] = np.uint32(0)
                if cuda.threadIdx.x == 0:
                    scales[r] = np.float32(1.0)
                return
            row = a // top_k
        amax = np.float32(0.0)
        for j in range(cuda.threadIdx.x, words, QUANT_THREADS):
            v0, v1, v2, v3 = load4(src, row, j)
            for v in (v0, v1, v2, v3):
                if v != v or abs(v) == np.float32(np.inf):
                    amax = np.float32(np.nan)
                elif amax == amax:
                    amax = max(amax, abs(v))
        amax = _block_max(amax)
        # a row of subnormals: max / limit underflows to 0; the smallest float32 holds it (common.quant does the same)
        scale = max(amax / limit, _SMALLEST_SCALE) if amax > np.float32(0.0) else np.float32(1.0)
        # a subnormal max / limit rounds down by up to a third: one float32 step up keeps the row's largest values
        # within the limit instead of saturating them (common.quant does the same)
        if scale < _TINY and amax / scale > limit:
            scale = u32_as_f32(f32_as_u32(scale) + np.uint32(1))
        if amax != amax:
            scale = amax
        if cuda.threadIdx.x == 0:
            scales[r] = scale
        for j in range(cuda.threadIdx.x, words, QUANT_THREADS):
            v0, v1, v2, v3 = load4(src, row, j)
            q4[r, j] = (to_byte(v0 / scale) | (to_byte(v1 / scale) << np.uint32(8))
                        | (to_byte(v2 / scale) << np.uint32(16)) | (to_byte(v3 / scale) << np.uint32(24)))

    return quantize_rows_kernel, cached_jit(quantize_rows_kernel)


def _check_out(q, scales, rows: int, width: int) -> None:
    if q.shape != (rows, width) or np.dtype(q.dtype) != np.uint8 or not q.flags["C_CONTIGUOUS"]:
        raise ValueError(f"quantize_rows: q must be C-contiguous uint8 [{rows}, {width}], got {q.dtype} {list(q.shape)}")
    if scales.shape != (rows,) or np.dtype(scales.dtype) != np.float32:
        raise ValueError(f"quantize_rows: scales must be float32 [{rows}], got {scales.dtype} {list(scales.shape)}")
    if width % 4:
        raise ValueError(f"quantize_rows: the row width must be a multiple of 4, got {width}")


def _code(code: int) -> int:
    if code not in DTYPES:
        raise ValueError(f"quantize_rows: code {code} is neither int8 ({CODE_INT8}) nor fp8 ({CODE_FP8})")
    return code


def _run(gathered: bool, src, sorted_ids, num_tiles, top_k: int, block_m: int, code: int, q, scales, stream) -> None:
    """Checks the outputs against src [rows, width] (x gathered through sorted_ids, or h row by row) and launches
    one block a row."""
    rows, width = (sorted_ids.shape[0] if gathered else src.shape[0]), src.shape[1]
    _check_out(q, scales, rows, width)
    if rows == 0 or width == 0:
        return
    _build(gathered, _code(code))[1][rows, QUANT_THREADS, stream](
        src if gathered else src.view(np.uint32), sorted_ids, num_tiles, np.int32(top_k), np.int32(block_m),
        q.view(np.uint32), scales)


def launch_quantize_gathered(x, sorted_ids, num_tiles, top_k: int, block_m: int, code: int, q, scales,
                             stream=0) -> None:
    """x [T, D] float32, sorted_ids [rows] / num_tiles [1] int32 from launch_moe_align -> q [rows, D] uint8 (the
    8-bit codes of each sorted row's token, `code`: CODE_INT8 or CODE_FP8) and scales [rows] float32, in the used
    rows (padding rows: zeros, scale 1)."""
    rows = sorted_ids.shape[0]
    if x.ndim != 2 or np.dtype(x.dtype) != np.float32 or not x.flags["C_CONTIGUOUS"] or rows % block_m:
        raise ValueError(f"quantize_rows: x must be C-contiguous float32 [T, D] and rows a multiple of BM, got "
                         f"{x.dtype} {list(x.shape)}, {rows} rows, BM {block_m}")
    _run(True, x, sorted_ids, num_tiles, top_k, block_m, code, q, scales, stream)


def launch_quantize_rows(h, num_tiles, block_m: int, code: int, q, scales, stream=0) -> None:
    """h [rows, F] uint16 (bf16), num_tiles [1] int32 -> q [rows, F] uint8 and scales [rows] float32 in the first
    num_tiles * block_m rows."""
    rows = h.shape[0]
    if h.ndim != 2 or np.dtype(h.dtype) != np.uint16 or not h.flags["C_CONTIGUOUS"] or rows % block_m:
        raise ValueError(f"quantize_rows: h must be C-contiguous uint16 (bf16) [rows, F] with rows a multiple of BM, "
                         f"got {h.dtype} {list(h.shape)}, BM {block_m}")
    _run(False, h, num_tiles, num_tiles, 1, block_m, code, q, scales, stream)  # (sorted_ids: unused, any int32)


def quantize_rows_reference(values: np.ndarray, code: int) -> tuple[np.ndarray, np.ndarray]:
    """values [rows, width] float32 (finite) -> (q [rows, width] uint8, scales [rows] float32), as the kernel."""
    q, scales = common_quant.quantize(values, DTYPES[_code(code)], common_quant.CHANNEL, "activations")
    return np.ascontiguousarray(q).view(np.uint8), scales.astype(np.float32).reshape(-1)


def through_8bit(rows: np.ndarray, code: int) -> np.ndarray:
    """rows [n, width] -> the values W8A8 multiplies: quantized per row (quantize_rows_reference), then decoded."""
    q, scales = quantize_rows_reference(np.ascontiguousarray(rows, dtype=np.float32), code)
    return decode(q.reshape(-1), code).reshape(q.shape).astype(np.float32) * scales[:, None]


def w8a8_swiglu_reference(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, code: int) -> np.ndarray:
    """One routed expert's SwiGLU MLP with W8A8's roundings (the cpu backend's swiglu_mlp otherwise): x [n, D] through
    8 bits, h = silu(x gate^T) * (x up^T) rounded to bf16 and through 8 bits, then h down^T. Weights as given."""
    xq = through_8bit(x, code)
    gs = xq @ gate.T
    h = gs / (np.float32(1.0) + np.exp(-gs)) * (xq @ up.T)
    return through_8bit(bf16_to_float32(float32_to_bf16(h.astype(np.float32))), code) @ down.T


def sm90_signatures():
    """(python function, numba signature) of each source and code."""
    from numba import types

    i1, i32, f1, u2 = types.int32[::1], types.int32, types.float32[::1], types.uint32[:, ::1]
    return [
        (_build(gathered, code)[0], (types.float32[:, ::1] if gathered else u2, i1, i1, i32, i32, u2, f1))
        for gathered in (True, False)
        for code in (CODE_INT8, CODE_FP8)
    ]
