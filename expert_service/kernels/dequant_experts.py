"""Dequantise a group of a layer's active experts into dense scratch blocks for the per-expert cuBLAS GEMMs of
large steps (CUBLAS_PER_EXPERT on 8-bit layers): scratch[j] = gate|up|down of the layer's (first + j)-th active
expert (in expert order; active: offsets[e+1] > offsets[e]) as the dense dtype, q * scale rounded to nearest.
Reference: ``expert_quant.dequantize``.

The active experts are found on the device from the step's grouping offsets, so the host only says which group
(`first`), never which experts: no upload between groups. Each thread widens one 32-bit word of 8-bit weights
(4 values) or two of 16-bit ones; the dense write is 2x (bf16) the 8-bit read, and the GEMMs then read it once
more, which at prefill sizes is small beside their arithmetic.
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
    META_WIDTH,
    SCALE_BLOCK,
    SCALE_BLOCK_SIZE,
    SCALE_CHANNEL,
    byte_at,
)
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR, f16_to_f32, storer, u32_as_f32

THREADS = 32 if SIMULATOR else 256
VALUES = 4  # values per thread (one 8-bit word); F and D are multiples of 16, so a row holds whole groups
_DTYPES = (np.uint16, np.float16, np.float32)  # the scratch's dense dtype (uint16 = bfloat16 bits)


@functools.cache
def _kernel(dtype):
    store = storer(dtype)

    def kernel(words, scales, meta, stride, offsets, first, F, D, out):
        """words / scales: the layer's expert buffer [E, stride] as flat uint32 / float32; meta [E, META_WIDTH]
        int32; stride: bytes per expert; offsets [E+1] int32 (the step's grouping); first: index of the group's
        first active expert; out [G, 3*F*D] dense dtype (gate, up, down back to back). Grid (G, value blocks),
        THREADS threads; slots past the last active expert are left untouched."""
        j = cuda.blockIdx.y  # the expert (the grid's x holds the many chunks: y and z stop at 65535)
        E = offsets.shape[0] - 1
        e = -1
        seen = 0
        for k in range(E):  # the (first + j)-th expert with tokens
            if offsets[k + 1] > offsets[k]:
                if seen == first + j:
                    e = k
                    break
                seen += 1
        if e < 0:
            return
        i = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * VALUES
        fd = F * D
        if i >= 3 * fd:
            return
        m = i // fd
        n_in = D if m < 2 else F
        local = i - m * fd
        r = local // n_in
        c = local - r * n_in
        code = meta[e, 0]
        scheme = meta[e, 1]
        base = e * stride
        factor = np.float32(1.0)
        if scheme == SCALE_CHANNEL:
            factor = scales[(base + meta[e, 5 + m]) // 4 + r]
        elif scheme == SCALE_BLOCK:
            n_cb = (n_in + SCALE_BLOCK_SIZE - 1) // SCALE_BLOCK_SIZE
            factor = scales[(base + meta[e, 5 + m]) // 4 + (r // SCALE_BLOCK_SIZE) * n_cb + c // SCALE_BLOCK_SIZE]
        o = j * 3 * fd + i
        if code == CODE_F32:
            w0 = (base + meta[e, 2 + m] + local * 4) // 4
            for q in range(VALUES):
                store(out, o + q, u32_as_f32(words[w0 + q]))
        elif code == CODE_BF16 or code == CODE_F16:
            w0 = (base + meta[e, 2 + m] + local * 2) // 4
            for q in range(2):
                w = words[w0 + q]
                if code == CODE_BF16:
                    lo = u32_as_f32(w << np.uint32(16))
                    hi = u32_as_f32(w & np.uint32(0xFFFF0000))
                else:
                    lo = f16_to_f32(w & np.uint32(0xFFFF))
                    hi = f16_to_f32(w >> np.uint32(16))
                store(out, o + 2 * q, lo)
                store(out, o + 2 * q + 1, hi)
        else:
            w = words[(base + meta[e, 2 + m] + local) // 4]
            for b in range(VALUES):
                store(out, o + b, byte_at(w, b, code) * factor)

    return kernel, cached_jit(kernel)


def launch_dequant_experts(experts, meta, offsets, first: int, F: int, D: int, out, stream=0) -> None:
    """experts uint8 [E, stride]; meta [E, META_WIDTH] int32; offsets [E+1] int32 (device); out [G, 3*F*D]
    uint16 (bf16) / float16 / float32: out[j] = the (first + j)-th active expert, dequantised."""
    E = experts.shape[0]
    if experts.ndim != 2 or np.dtype(experts.dtype) != np.uint8 or experts.shape[1] % 4:
        raise ValueError(f"experts must be uint8 [E, stride], got {experts.dtype} {list(experts.shape)}")
    if meta.shape != (E, META_WIDTH) or offsets.shape != (E + 1,) or F % 16 or D % 16:
        raise ValueError(f"meta {list(meta.shape)} / offsets {list(offsets.shape)} for {E} experts, F={F}, D={D}")
    if out.ndim != 2 or out.shape[1] != 3 * F * D or np.dtype(out.dtype) not in [np.dtype(d) for d in _DTYPES]:
        raise ValueError(f"out must be [G, {3 * F * D}] bfloat16/float16/float32, got {out.dtype} {list(out.shape)}")
    flat = experts.reshape(experts.size)
    grid = (-(-3 * F * D // (VALUES * THREADS)), out.shape[0])
    _kernel(np.dtype(out.dtype).type)[1][grid, THREADS, stream](
        flat.view(np.uint32),
        flat.view(np.float32),
        meta,
        experts.shape[1],
        offsets,
        first,
        F,
        D,
        out.reshape(out.size),
    )


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
                numpy_support.from_dtype(np.dtype(dt))[::1],
            ),
        )
        for dt in _DTYPES
    ]
