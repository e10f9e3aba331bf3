"""Device helpers shared by the kernels: 16-bit <-> float32 conversion and reductions.

Real GPU: bfloat16 widening is a shift into the top half of a float32 word (exact), narrowing rounds to
nearest even; reductions use warp shuffles. Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) libdevice
and shuffles do not exist, so the same names are bound to Python equivalents that give identical results.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import config

SIMULATOR = bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]  # set from the environment at import: no stub has it
WARP = 32
FULL_MASK = 0xFFFFFFFF
SPREAD_TARGET_BLOCKS = 528   # small steps spread a row over blocks until the grid has about this many (4 per SM)


def device_pointer(a) -> int:
    """Where a (device or simulator) array starts: its device address, or under the simulator its host one (0 for
    an empty array)."""
    pointer = a.device_ctypes_pointer.value if hasattr(a, "device_ctypes_pointer") else a.ctypes.data
    return pointer or 0


def aligned_to(nbytes: int, *arrays) -> bool:
    """Every (device or simulator) array starts on an nbytes boundary: e.g. 8, a uint64 view of it may be loaded
    and stored (the wide paths of the 16-bit casts; a view sliced at an odd offset falls back to their scalar
    path); 16, the grouped GEMM's 16-byte copies."""
    return all(device_pointer(a) % nbytes == 0 for a in arrays)


def check_array(name: str, a, shape, dtype) -> None:
    """A launcher's argument check: `a` is C-contiguous `dtype` of `shape`, else a ValueError naming it."""
    if a.shape != tuple(shape) or np.dtype(a.dtype) != np.dtype(dtype) or not a.flags["C_CONTIGUOUS"]:
        raise ValueError(
            f"{name} must be C-contiguous {np.dtype(dtype).name} {list(shape)}, got {a.dtype} {list(a.shape)}"
        )


def blocks_per_row(rows: int, work: int, threads: int) -> int:
    """Blocks that share one row of `work` independent items in a (rows, Y) grid: at most one item per thread and
    about SPREAD_TARGET_BLOCKS blocks in all, so Y = 1 for large steps and a decode token's row is not one block's
    serial chain of loads."""
    return max(1, min(-(-work // threads), SPREAD_TARGET_BLOCKS // max(rows, 1)))

if SIMULATOR:
    @cuda.jit(device=True)
    def bf16_to_f32(u):
        return np.array([np.uint32(u) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_to_bf16(x):
        bits = np.array([x], dtype=np.float32).view(np.uint32)[0]
        if math.isnan(x):
            return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
        return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(u):
        return libdevice.int_as_float(np.int32(np.uint32(u) << np.uint32(16)))

    @cuda.jit(device=True, inline=True)
    def f32_to_bf16(x):
        bits = np.uint32(libdevice.float_as_int(x))
        if math.isnan(x):
            return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
        return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@cuda.jit(device=True, inline=True)
def _load_bf16(a, i):
    return bf16_to_f32(a[i])


@cuda.jit(device=True, inline=True)
def _load_float(a, i):
    return np.float32(a[i])


@cuda.jit(device=True, inline=True)
def _store_bf16(a, i, x):
    a[i] = f32_to_bf16(x)


@cuda.jit(device=True, inline=True)
def _store_float(a, i, x):
    a[i] = x


def loader(dtype):
    """Device function `load(array, flat_index) -> float32` for arrays of storage dtype `dtype`."""
    return _load_bf16 if np.dtype(dtype) == np.uint16 else _load_float


def storer(dtype):
    """Device function `store(array, flat_index, float32)` rounding to the storage dtype."""
    return _store_bf16 if np.dtype(dtype) == np.uint16 else _store_float


if SIMULATOR:
    # The simulator runs every thread of a block as a Python thread; a block-wide shared scratch makes the
    # butterfly exchange explicit. Each warp uses its own 32-slot window.
    @cuda.jit(device=True)
    def warp_sum(value):
        scratch = cuda.shared.array(1024, dtype=np.float32)
        lane = cuda.threadIdx.x % WARP
        base = cuda.threadIdx.x - lane
        scratch[cuda.threadIdx.x] = value
        cuda.syncthreads()
        total = np.float32(0.0)
        for j in range(WARP):
            total += scratch[base + j]
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def warp_max(value):
        scratch = cuda.shared.array(1024, dtype=np.float32)
        lane = cuda.threadIdx.x % WARP
        base = cuda.threadIdx.x - lane
        scratch[cuda.threadIdx.x] = value
        cuda.syncthreads()
        best = scratch[base]
        for j in range(1, WARP):
            best = max(best, scratch[base + j])
        cuda.syncthreads()
        return best

    @cuda.jit(device=True)
    def _quad(value, take_max):
        scratch = cuda.shared.array(1024, dtype=np.float32)
        tid = cuda.threadIdx.x
        scratch[tid] = value
        cuda.syncthreads()
        first = tid - tid % 4
        r = scratch[first]
        for j in range(1, 4):
            r = max(r, scratch[first + j]) if take_max else r + scratch[first + j]
        cuda.syncthreads()
        return r

    @cuda.jit(device=True)
    def quad_max(value):
        return _quad(value, True)

    @cuda.jit(device=True)
    def quad_sum(value):
        return _quad(value, False)
else:
    @cuda.jit(device=True, inline=True)
    def quad_max(value):
        """Max over the 4 lanes of the caller's quad (lanes 4g .. 4g + 3: an mma fragment's row), every lane of
        the warp calling (in the simulator: every thread of the block)."""
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, 1))
        return max(value, cuda.shfl_xor_sync(FULL_MASK, value, 2))

    @cuda.jit(device=True, inline=True)
    def quad_sum(value):
        value += cuda.shfl_xor_sync(FULL_MASK, value, 1)
        return value + cuda.shfl_xor_sync(FULL_MASK, value, 2)

    @cuda.jit(device=True, inline=True)
    def warp_sum(value):
        """Sum over the 32 lanes of the calling warp; every lane gets the total (all lanes must call)."""
        offset = 16
        while offset > 0:
            value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
            offset //= 2
        return value

    @cuda.jit(device=True, inline=True)
    def warp_max(value):
        offset = 16
        while offset > 0:
            value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
            offset //= 2
        return value


# ---- bit casts of packed words and block reductions (used by the dense kernels) ----
if SIMULATOR:
    @cuda.jit(device=True)
    def u32_as_f32(u):
        return np.array([u], dtype=np.uint64).astype(np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_as_u32(x):
        return np.array([x], dtype=np.float32).view(np.uint32)[0]

    @cuda.jit(device=True)
    def f16_to_f32(u):
        return np.float32(np.array([u], dtype=np.uint64).astype(np.uint16).view(np.float16)[0])
else:
    from numba.cuda import libdevice as _libdevice

    @cuda.jit(device=True, inline=True)
    def u32_as_f32(u):
        """The float32 whose bits are the low 32 bits of integer `u`."""
        return _libdevice.int_as_float(np.int32(np.uint32(u)))

    @cuda.jit(device=True, inline=True)
    def f32_as_u32(x):
        """The bits of float32 `x` as a uint32 (u32_as_f32's inverse)."""
        return np.uint32(_libdevice.float_as_int(x))

    @cuda.jit(device=True, inline=True)
    def f16_to_f32(u):
        """float16 bits (low 16 bits of `u`) -> float32, exact: subnormals via a 2**112 rescale (no FTZ)."""
        h = np.uint32(u) & np.uint32(0xFFFF)
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
        if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
            return u32_as_f32(sign | np.uint32(0x7F800000) | mag)
        f = u32_as_f32(mag) * np.float32(5.192296858534828e+33)
        return u32_as_f32(np.uint32(_libdevice.float_as_int(f)) | sign)


@cuda.jit(device=True, inline=True)
def _widen_bf16(v):
    return bf16_to_f32(v)


@cuda.jit(device=True, inline=True)
def _widen_float(v):
    return np.float32(v)


def widener(dtype):
    """Device function `widen(element) -> float32` for one element of storage dtype `dtype`."""
    return _widen_bf16 if np.dtype(dtype) == np.uint16 else _widen_float


@cuda.jit(device=True, inline=True)
def silu(v):
    """v * sigmoid(v) in float32, as x / (1 + exp(-x)): the SwiGLU activation of every kernel that applies it."""
    return v / (np.float32(1.0) + math.exp(-v))


@cuda.jit(device=True, inline=True)      # inline: compile_ptx of a caller then needs no device
def block_sum(value):
    """Sum over all threads of the block (blockDim.x a multiple of 32, <= 1024); every thread gets the total.
    Every thread of the block must call it (it synchronises)."""
    partial = cuda.shared.array(32, dtype=np.float32)
    total = warp_sum(value)
    if cuda.threadIdx.x % WARP == 0:
        partial[cuda.threadIdx.x // WARP] = total
    cuda.syncthreads()
    total = np.float32(0.0)
    for i in range(cuda.blockDim.x // WARP):
        total += partial[i]
    cuda.syncthreads()
    return total


# ---- four float32 -> four 16-bit words in one uint64 (wide stores of the casts and the bf16 gather) ----
@cuda.jit(device=True, inline=True)
def bf16_bits(bits):
    """uint32 bits of a float32 -> its bfloat16 bits (uint32, high half zero): `f32_to_bf16` on the raw word
    (nearest even; NaN stays NaN, quiet). Every step is truncated back to uint32 (Numba widens uint32
    arithmetic to 64 bits, which the GPU runs as two instructions)."""
    u32 = np.uint32
    high = u32(bits >> u32(16))
    if u32(bits & u32(0x7FFFFFFF)) > u32(0x7F800000):
        return u32(high | u32(0x40))
    return u32(u32(u32(bits + u32(0x7FFF)) + u32(high & u32(1))) >> u32(16))


if SIMULATOR:
    @cuda.jit(device=True)
    def f16_bits(bits):
        with np.errstate(over="ignore"):        # overflow to inf is the rounding asked for
            return np.uint32(np.array([bits], np.uint32).view(np.float32).astype(np.float16).view(np.uint16)[0])
else:
    @cuda.jit(device=True, inline=True)
    def f16_bits(bits):
        """uint32 bits of a float32 -> its float16 bits (uint32, high half zero), cvt.rn as a float16 store."""
        return np.uint32(np.uint16(_libdevice.float2half_rn(_libdevice.int_as_float(np.int32(bits)))))


def _packer4(narrow):
    @cuda.jit(device=True, inline=True)
    def pack4(lo, hi):
        u32, half = np.uint32, np.uint64(32)
        first = u32(narrow(u32(lo)) | u32(narrow(u32(lo >> half)) << u32(16)))
        second = u32(narrow(u32(hi)) | u32(narrow(u32(hi >> half)) << u32(16)))
        return np.uint64(first) | (np.uint64(second) << half)
    return pack4


_PACK4 = {"bf16": _packer4(bf16_bits), "f16": _packer4(f16_bits)}


def packer4(dtype):
    """Device function `pack4(lo, hi) -> uint64` for 16-bit storage dtype `dtype` (uint16 = bfloat16 bits, or
    float16): four float32 given as two uint64 words of their bits (element 0 in the low half of lo) ->
    one word of their four 16-bit values (element 0 in the low 16 bits), rounded as `storer(dtype)` rounds."""
    return _PACK4["bf16" if np.dtype(dtype) == np.uint16 else "f16"]
