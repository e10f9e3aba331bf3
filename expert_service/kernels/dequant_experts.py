"""Dequantise a group of a layer's active experts into dense scratch blocks for the per-expert cuBLAS GEMMs of
large steps (CUBLAS_PER_EXPERT on 8-bit layers): scratch[j] = gate|up|down of the layer's (first + j)-th active
expert (in expert order; active: offsets[e+1] > offsets[e]) as the dense dtype, q * scale rounded to nearest.
Reference: ``expert_quant.dequantize``.

The active experts are found on the device from the step's grouping offsets, so the host only says which group
(`first`), never which experts: no upload between groups (one thread of each block finds its expert). A block
covers part of one weight row (grid: the row blocks of all 3 matrices x G, one launch: each gate and up row gets
the blocks its D values need, each down row those of its F, so no block idles, and the host pays one launch a
group: these steps wait on the host's launches as much as on the device), each thread one 16-value chunk: a 16-byte streaming load of 8-bit weights (two / four for 16-bit / f32 experts),
widened in registers as moe_q8 does, written as four 8-byte words of bf16 / f16 (float32 scratch: 16 stores).
The dense write is 2x (bf16) the 8-bit read, and the GEMMs then read it once more: at prefill sizes this pass is
the 8-bit path's whole overhead over bf16, so it must run at the HBM roofline (docs/kernels.md).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types
from numba.np import numpy_support

from expert_service.kernels.expert_quant import (
    CODE_BF16,
    CODE_F16,
    CODE_F32,
    CODE_FP8,
    CODE_INT8,
    META_WIDTH,
    SCALE_BLOCK,
    SCALE_BLOCK_SIZE,
    SCALE_CHANNEL,
    fp8x4,
    int8x4,
)
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR, f16_to_f32, packer4, storer, u32_as_f32
from expert_service.kernels.ptx import ld_stream_v4

THREADS = 8 if SIMULATOR else 128  # the simulator pays per thread; short test rows need few
VALUES = 16  # values per thread: one 16-byte chunk of an 8-bit row (F and D are multiples of 16)
DENSE_DTYPES = (np.uint16, np.float16, np.float32)  # the scratch's dense dtype (uint16 = bfloat16 bits)

if SIMULATOR:

    @cuda.jit(device=True)
    def f32_bits(x):
        return np.uint64(np.array([x], np.float32).view(np.uint32)[0])

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def f32_bits(x):
        return np.uint64(np.uint32(libdevice.float_as_int(x)))


@cuda.jit(device=True, inline=True)
def widen_chunk(words, w0, code, v):
    """The 16 values starting at word w0 (one chunk of an 8-bit row, two of a 16-bit one, four of f32) into v."""
    if code == CODE_INT8 or code == CODE_FP8:
        a = ld_stream_v4(words, w0)
        for q in range(4):
            if code == CODE_INT8:
                v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3] = int8x4(a[q])
            else:
                v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3] = fp8x4(a[q])
    elif code == CODE_F32:
        for h in range(4):
            a = ld_stream_v4(words, w0 + 4 * h)
            for q in range(4):
                v[4 * h + q] = u32_as_f32(a[q])
    else:
        for h in range(2):
            a = ld_stream_v4(words, w0 + 4 * h)
            for q in range(4):
                w = a[q]
                if code == CODE_BF16:
                    v[8 * h + 2 * q] = u32_as_f32(w << np.uint32(16))
                    v[8 * h + 2 * q + 1] = u32_as_f32(w & np.uint32(0xFFFF0000))
                else:
                    v[8 * h + 2 * q] = f16_to_f32(w & np.uint32(0xFFFF))
                    v[8 * h + 2 * q + 1] = f16_to_f32(w >> np.uint32(16))


@functools.cache
def chunk_storer(dtype):
    """Device function `store_chunk(v, factor, out, out64, o)`: the VALUES values v[k] * factor, rounded to `dtype`,
    into the flat `out` from element o (a multiple of 16); 16-bit dtypes four values a store through out64 (the same
    bytes as uint64), float32 one a store."""
    store = storer(dtype)
    narrow = np.dtype(dtype).itemsize == 2
    pack4 = packer4(dtype if narrow else np.uint16)

    @cuda.jit(device=True, inline=True)
    def store_chunk(v, factor, out, out64, o):
        if narrow:
            for q in range(VALUES // 4):
                lo = f32_bits(v[4 * q] * factor) | (f32_bits(v[4 * q + 1] * factor) << np.uint64(32))
                hi = f32_bits(v[4 * q + 2] * factor) | (f32_bits(v[4 * q + 3] * factor) << np.uint64(32))
                out64[o // 4 + q] = pack4(lo, hi)
        else:
            for k in range(VALUES):
                store(out, o + k, v[k] * factor)

    return store_chunk


@functools.cache
def _kernel(dtype):
    store_chunk = chunk_storer(dtype)

    def kernel(words, scales, meta, stride, offsets, first, F, D, gu_chunks, down_chunks, out, out64):
        """words / scales: the layer's expert buffer [E, stride] as flat uint32 / float32; meta [E, META_WIDTH]
        int32; stride: bytes per expert; offsets [E+1] int32 (the step's grouping); first: index of the group's
        first active expert; out [G, 3*F*D] dense dtype (gate, up, down back to back), flat, and out64 the same
        bytes as uint64 (16-bit scratch: four values per store); gu_chunks / down_chunks: blocks per gate or up row
        (D values) / per down row (F values). Grid (2F * gu_chunks + D * down_chunks, G), THREADS threads, each
        widening one 16-value chunk; slots past the last active expert are untouched."""
        pick = cuda.shared.array(1, np.int32)
        j = cuda.blockIdx.y
        if cuda.threadIdx.x == 0:  # the (first + j)-th expert with tokens, found once per block
            E = offsets.shape[0] - 1
            pick[0] = -1
            seen = 0
            for k in range(E):
                if offsets[k + 1] > offsets[k]:
                    if seen == first + j:
                        pick[0] = k
                        break
                    seen += 1
        cuda.syncthreads()
        e = pick[0]
        b = cuda.blockIdx.x
        gu_blocks = 2 * F * gu_chunks
        if b < gu_blocks:  # one division a block: which row and which part of it
            row = b // gu_chunks
            chunk = b - row * gu_chunks
        else:
            down_row = (b - gu_blocks) // down_chunks
            row = 2 * F + down_row
            chunk = b - gu_blocks - down_row * down_chunks
        m = 0 if row < F else (1 if row < 2 * F else 2)  # gate, up, down
        r = row - m * F
        n_in = D if m < 2 else F
        c = (chunk * cuda.blockDim.x + cuda.threadIdx.x) * VALUES
        if e < 0 or c >= n_in:
            return
        code = meta[e, 0]
        scheme = meta[e, 1]
        base = e * stride
        factor = np.float32(1.0)
        if scheme == SCALE_CHANNEL:
            factor = scales[(base + meta[e, 5 + m]) // 4 + r]
        elif scheme == SCALE_BLOCK:
            n_cb = (n_in + SCALE_BLOCK_SIZE - 1) // SCALE_BLOCK_SIZE
            factor = scales[(base + meta[e, 5 + m]) // 4 + (r // SCALE_BLOCK_SIZE) * n_cb + c // SCALE_BLOCK_SIZE]
        nb = 4 if code == CODE_F32 else (2 if code == CODE_BF16 or code == CODE_F16 else 1)
        v = cuda.local.array(VALUES, np.float32)
        widen_chunk(words, (base + meta[e, 2 + m] + (r * n_in + c) * nb) // 4, code, v)
        store_chunk(v, factor, out, out64, j * 3 * F * D + m * F * D + r * n_in + c)  # a multiple of 16

    return kernel, cached_jit(kernel)


def launch_dequant_experts(experts, meta, offsets, first: int, F: int, D: int, out, stream=0) -> None:
    """experts uint8 [E, stride]; meta [E, META_WIDTH] int32; offsets [E+1] int32 (device); out [G, 3*F*D]
    uint16 (bf16) / float16 / float32: out[j] = the (first + j)-th active expert, dequantised."""
    DequantInto(experts, meta, offsets, F, D, out)(first, out.shape[0], stream)


class DequantInto:
    """launch_dequant_experts on fixed buffers with its views made once: a call widens experts into the first g
    rows of `out` with one launch (every device-array view made costs tens of microseconds of host, and the
    per-expert GEMMs' host break widens a group of experts a call)."""

    def __init__(self, experts, meta, offsets, F: int, D: int, out):
        """The arguments of launch_dequant_experts but `first`; out [G, 3*F*D] holds up to G experts a call."""
        E = experts.shape[0]
        if experts.ndim != 2 or np.dtype(experts.dtype) != np.uint8 or experts.shape[1] % 4:
            raise ValueError(f"experts must be uint8 [E, stride], got {experts.dtype} {list(experts.shape)}")
        if meta.shape != (E, META_WIDTH) or offsets.shape != (E + 1,) or F % 16 or D % 16:
            raise ValueError(f"meta {list(meta.shape)} / offsets {list(offsets.shape)} for {E} experts, F={F}, D={D}")
        if out.ndim != 2 or out.shape[1] != 3 * F * D or np.dtype(out.dtype) not in [np.dtype(d) for d in DENSE_DTYPES]:
            raise ValueError(f"out must be [G, {3 * F * D}] bfloat16/float16/float32, got {out.dtype} {list(out.shape)}")
        if out.shape[0] > 65535:
            raise ValueError(f"a group of {out.shape[0]} experts exceeds the grid's 65535")
        flat = experts.reshape(experts.size)
        flat_out = out.reshape(out.size)
        out64 = flat_out.view(np.uint64) if np.dtype(out.dtype).itemsize == 2 else flat.view(np.uint64)[:1]
        self.kernel = _kernel(np.dtype(out.dtype).type)[1]
        self.capacity = out.shape[0]
        # Each row gets the blocks its length needs: a grid sized for the longest rows left most blocks of the
        # other matrices' rows with nothing to do (mixtral-shape: 5 of 7 on every gate and up row).
        gu_chunks, down_chunks = -(-D // (VALUES * THREADS)), -(-F // (VALUES * THREADS))
        self.blocks = 2 * F * gu_chunks + D * down_chunks
        self.head = (flat.view(np.uint32), flat.view(np.float32), meta, experts.shape[1], offsets)
        self.tail = (F, D, gu_chunks, down_chunks, flat_out, out64)

    def __call__(self, first: int, g: int, stream=0) -> None:
        """out[j] = the (first + j)-th active expert, dequantised, for j < g (0 < g <= out's rows)."""
        assert 0 < g <= self.capacity, (g, self.capacity)
        self.kernel[(self.blocks, g), THREADS, stream](*self.head, first, *self.tail)


def sm90_signatures():
    """(python function, numba signature) per scratch dtype, for the sm_90 compile check."""
    i64 = types.int64
    return [
        (
            _kernel(dt)[0],
            (
                types.uint32[::1],
                types.float32[::1],
                types.int32[:, ::1],
                i64,
                types.int32[::1],
                i64,
                i64,
                i64,
                i64,
                i64,
                numpy_support.from_dtype(np.dtype(dt))[::1],
                types.uint64[::1],
            ),
        )
        for dt in DENSE_DTYPES
    ]
