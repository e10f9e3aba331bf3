"""8-bit expert blocks on the device: dtype and scale codes, the per-expert metadata the kernels read, the
device-side decoders, and the numpy reference every 8-bit kernel is tested against.

An expert block (model format version 2) holds gate [F, D], up [F, D], down [D, F] row-major [out, in] in the
expert's dtype, then, for 8-bit experts, their float32 scales (gate, up, down); every tensor starts at a multiple
of 256 bytes. A scale is a multiplier: w = q * scale. Per output channel the scale is [out]; in 128x128 blocks it
is [ceil(out/128), ceil(in/128)] (fine-grained fp8 checkpoints).

A layer's experts are one uint8 buffer [E, stride]; the kernels read it as uint32 words (weights) and float32
(scales) and find each expert's dtype and tensors in `meta` [E, META_WIDTH] int32, so one launch serves a layer
whose experts mix dtypes:
  meta[e] = (code, scheme, gate, up, down, gate scale, up scale, down scale)   offsets in bytes inside the block
Codes: CODE_BF16 / CODE_F16 / CODE_F32 (unquantized, scheme SCALE_NONE), CODE_INT8, CODE_FP8 (e4m3fn).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import cuda

from common import quant as common_quant
from expert_service.kernels.numeric import u32_as_f32
from expert_service.kernels.ptx import prmt_fn

CODE_BF16, CODE_F16, CODE_INT8, CODE_FP8, CODE_F32 = 0, 1, 2, 3, 4
SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK = 0, 1, 2
CODES = {"bfloat16": CODE_BF16, "float16": CODE_F16, "int8": CODE_INT8, "float8_e4m3fn": CODE_FP8, "float32": CODE_F32}
SCHEMES = {None: SCALE_NONE, "channel": SCALE_CHANNEL, "block128": SCALE_BLOCK}  # common.quant's names
META_WIDTH = 8
SCALE_BLOCK_SIZE = 128
TENSOR_ALIGN = 256
# The 8-bit block scale varies every 128 input values; a 16-byte chunk (16 values) never straddles two blocks.
CHUNK_BYTES = 16


def element_bytes(code: int) -> int:
    return 4 if code == CODE_F32 else (2 if code in (CODE_BF16, CODE_F16) else 1)


def scale_shape(scheme: int, rows: int, cols: int) -> tuple[int, ...]:
    if scheme == SCALE_CHANNEL:
        return (rows,)
    if scheme == SCALE_BLOCK:
        return (-(-rows // SCALE_BLOCK_SIZE), -(-cols // SCALE_BLOCK_SIZE))
    return (0,)


def _align(n: int) -> int:
    return -(-n // TENSOR_ALIGN) * TENSOR_ALIGN


def block_offsets(code: int, scheme: int, F: int, D: int) -> tuple[int, ...]:
    """(gate, up, down, gate scale, up scale, down scale) byte offsets and the block's size, in the agreed
    layout; unquantized experts report their scale offsets as the block size (nothing there)."""
    matrix = _align(F * D * element_bytes(code))
    offsets = [0, matrix, 2 * matrix]
    end = 3 * matrix
    for rows, cols in ((F, D), (F, D), (D, F)):
        n = int(np.prod(scale_shape(scheme, rows, cols))) * 4 if scheme != SCALE_NONE else 0
        offsets.append(end)
        end += _align(n)
    return tuple(offsets) + (end,)


def meta_row(code: int, scheme: int, offsets) -> np.ndarray:
    if (code in (CODE_INT8, CODE_FP8)) == (scheme == SCALE_NONE):
        raise ValueError(f"dtype code {code} with scale scheme {scheme}: 8-bit experts need scales, others none")
    if any(int(o) % TENSOR_ALIGN for o in offsets[:6]):
        raise ValueError(f"expert tensor offsets {list(offsets[:6])} are not multiples of {TENSOR_ALIGN}")
    return np.array([code, scheme, *offsets[:6]], dtype=np.int32)


def layer_kinds(meta: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The distinct (code, scheme) pairs of a layer's host meta [E, META_WIDTH], sorted: what moe_q8 compiles its
    kernel for (one specialised path each)."""
    return tuple(sorted({(int(c), int(s)) for c, s in np.asarray(meta)[:, :2]}))


def shared_layout(meta: np.ndarray) -> tuple[int, ...] | None:
    """The meta row every expert of a layer has (host meta [E, META_WIDTH]: one encoding, the same offsets in each
    block), or None where any differs: what moe_q8's launchers take as `layout`."""
    meta = np.asarray(meta)
    if meta.ndim != 2 or not len(meta) or not (meta == meta[0]).all():
        return None
    return tuple(int(v) for v in meta[0])


# ---- numpy reference ----
def decode(raw: np.ndarray, code: int) -> np.ndarray:
    """Raw bytes of one tensor -> float32 values (not yet scaled)."""
    if code == CODE_BF16:
        return raw.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    if code == CODE_F16:
        return raw.view(np.float16).astype(np.float32)
    if code == CODE_F32:
        return raw.view(np.float32).copy()
    if code == CODE_INT8:
        return raw.view(np.int8).astype(np.float32)
    return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def dequantize(block: np.ndarray, meta: np.ndarray, F: int, D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One expert's uint8 block and its meta row -> gate [F, D], up [F, D], down [D, F] float32 (q * scale)."""
    code, scheme = int(meta[0]), int(meta[1])
    nb = element_bytes(code)
    out = []
    for k, (rows, cols) in enumerate(((F, D), (F, D), (D, F))):
        start = int(meta[2 + k])
        w = decode(np.ascontiguousarray(block[start : start + rows * cols * nb]), code).reshape(rows, cols)
        if scheme != SCALE_NONE:
            shape = scale_shape(scheme, rows, cols)
            s0 = int(meta[5 + k])
            s = np.ascontiguousarray(block[s0 : s0 + 4 * int(np.prod(shape))]).view(np.float32).reshape(shape)
            if scheme == SCALE_CHANNEL:
                w = w * s[:, None]
            else:
                full = np.repeat(np.repeat(s, SCALE_BLOCK_SIZE, 0), SCALE_BLOCK_SIZE, 1)[:rows, :cols]
                w = w * full
        out.append(w.astype(np.float32))
    return out[0], out[1], out[2]


def expert_ffn(x: np.ndarray, block: np.ndarray, meta: np.ndarray, F: int, D: int) -> np.ndarray:
    """x [n, D] float32 through one expert's SwiGLU -> [n, D] float32 (float64 sums)."""
    gate, up, down = (m.astype(np.float64) for m in dequantize(block, meta, F, D))
    xd = x.astype(np.float64)
    g = xd @ gate.T
    h = g / (1.0 + np.exp(-g)) * (xd @ up.T)
    return (h @ down.T).astype(np.float32)


def quantize(w: np.ndarray, code: int, scheme: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (raw bytes, float32 scale) in `code` / `scheme` (common.quant's quantiser for 8-bit
    codes). For tests and benches that need blocks without a converted checkpoint."""
    if code == CODE_BF16:
        return w.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(-1), np.zeros(0, np.float32)
    if code in (CODE_F16, CODE_F32):
        return w.astype(np.float16 if code == CODE_F16 else np.float32).view(np.uint8).reshape(-1), np.zeros(
            0, np.float32
        )
    name = {CODE_INT8: "int8", CODE_FP8: "float8_e4m3fn"}[code]
    scheme_name = next(k for k, v in SCHEMES.items() if v == scheme and k is not None)
    raw, s = common_quant.quantize(w, name, scheme_name, "synthetic")
    return raw.view(np.uint8).reshape(-1), s.reshape(-1)


def pack_block(gate, up, down, code: int, scheme: int, stride: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 gate/up/down -> (uint8 block of `stride` bytes (default: its own size), its meta row)."""
    F, D = gate.shape
    offs = block_offsets(code, scheme, F, D)
    block = np.zeros(stride if stride is not None else offs[6], np.uint8)
    for k, w in enumerate((gate, up, down)):
        raw, s = quantize(np.asarray(w, np.float32), code, scheme)
        block[offs[k] : offs[k] + raw.size] = raw
        if scheme != SCALE_NONE:
            block[offs[3 + k] : offs[3 + k] + 4 * s.size] = s.view(np.uint8)
    return block, meta_row(code, scheme, offs)


# ---- device decoders: one 32-bit word -> its values as float32 ----
FP8_RESCALE = np.float32(2.0**120)  # e4m3 bits moved into a float32's exponent/mantissa fields are 2**-120 too small


@cuda.jit(device=True, inline=True)
def int8_at(w, j):
    """Byte j of word w as a signed int8, as float32: the byte (sign flipped) is the mantissa of 2**23 + 128 + q."""
    b = (w >> np.uint32(8 * j)) & np.uint32(0xFF)
    return u32_as_f32(np.uint32(0x4B000000) | (b ^ np.uint32(0x80))) - np.float32(8388736.0)


@cuda.jit(device=True, inline=True)
def fp8_at(w, j):
    """Byte j of word w as e4m3fn, as float32 (exact for every finite value; subnormals included, no FTZ)."""
    b = (w >> np.uint32(8 * j)) & np.uint32(0xFF)
    bits = ((b & np.uint32(0x80)) << np.uint32(24)) | ((b & np.uint32(0x7F)) << np.uint32(20))
    return u32_as_f32(bits) * FP8_RESCALE


@cuda.jit(device=True, inline=True)
def byte_at(w, j, code):
    return int8_at(w, j) if code == CODE_INT8 else fp8_at(w, j)


# ---- the same decoders for a whole word, in as few integer instructions as the streaming kernels can afford ----
# prmt selectors: byte j of a into byte 0 and the constant word's top byte (0x4B) into byte 3 (int8); byte j of a
# into byte 3, zeros elsewhere (e4m3).
_int8_0, _int8_1, _int8_2, _int8_3 = (prmt_fn(j | 0x7540) for j in range(4))
_fp8_0, _fp8_1, _fp8_2 = (prmt_fn((j << 12) | 0x444) for j in range(3))
_INT8_FLOAT, _SIGN_FLIP = np.uint32(0x4B000000), np.uint32(0x80808080)
_FP8_FIELDS = np.uint32(0x87F00000)  # the sign and the 7 exponent/mantissa bits once shifted into a float32


@cuda.jit(device=True, inline=True)
def int8x4(w):
    """The 4 bytes of w (byte 0 first) as signed int8 values in float32, as int8_at: one prmt per value puts
    the sign-flipped byte under a 2**23 exponent, one subtraction removes the offset."""
    f = w ^ _SIGN_FLIP
    z = _INT8_FLOAT
    off = np.float32(8388736.0)
    return (
        u32_as_f32(_int8_0(f, z)) - off,
        u32_as_f32(_int8_1(f, z)) - off,
        u32_as_f32(_int8_2(f, z)) - off,
        u32_as_f32(_int8_3(f, z)) - off,
    )


@cuda.jit(device=True, inline=True)
def _fp8_top(t):
    """A word whose top byte is an e4m3 value -> that value in float32 (fp8_at): the arithmetic shift moves the 7
    low bits under the float32 exponent field and repeats the sign, the mask keeps one copy of it."""
    bits = np.uint32(np.int32(t) >> np.int32(4)) & _FP8_FIELDS
    return u32_as_f32(bits) * FP8_RESCALE


@cuda.jit(device=True, inline=True)
def fp8x4(w):
    """The 4 bytes of w (byte 0 first) as e4m3fn values in float32, exactly as fp8_at."""
    z = np.uint32(0)
    return (
        _fp8_top(_fp8_0(w, z)),
        _fp8_top(_fp8_1(w, z)),
        _fp8_top(_fp8_2(w, z)),
        _fp8_top(w),
    )
