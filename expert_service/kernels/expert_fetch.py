"""Device-driven expert copies: whole expert blocks from the page-locked host copy of the experts (read through
its mapped device address) into device slots, as listed by the slot map (expert_slot_map.py). Reference: numpy
`dst[slot] = src[expert]` for each listed pair (tests/expert_service/kernels/test_expert_fetch.py).

A kernel reading mapped host memory is a copy the device drives: it needs no host decision and a graph captures
it with a fixed grid whatever the list holds (an empty list returns at once). Reading host memory over PCIe
reaches the link's rate only with 16-byte coalesced loads from enough CTAs (>= 33 on the H200), so every thread
issues UNROLL 16-byte loads (consecutive threads, consecutive 16 bytes) before it stores them, and the grid is
CTAS blocks whatever the size: 66, one per two SMs, so the grouped kernels of the wave before run beside it
(pipelined waves; H200, mixtral-shape b=16 at 2 slots: 264 CTAs left them no room, 221 ms a step, 66 CTAs
181 ms, the copies themselves no slower). Blocks are whole `expert_block_bytes` ranges (a multiple of 16 bytes), so any
expert dtype (bf16, int8 with its scales, ...) copies unchanged.

  src [E * words] uint32   the layer's experts as the model stores them (mapped host memory; words = block / 4)
  dst [S * words] uint32   the layer's slot buffer
  expert, slot [>= c] int32, count [1] int32: copy expert[i] into slot[i] for i < count[0]
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.ptx import ld_stream_v4

THREADS = 32 if SIMULATOR else 256
CTAS = 2 if SIMULATOR else 66  # past the 33+ that saturate PCIe; the rest of the SMs compute beside the copy
UNROLL = 2 if SIMULATOR else 4  # 16-byte loads in flight per thread


@cached_jit
def _fetch_kernel(src, dst, expert, slot, count, words):
    """Module docstring; words: uint32 words per expert block (a multiple of 4)."""
    n = count[0]
    vecs = words // 4  # 16-byte vectors per block
    total = n * vecs
    step = cuda.gridDim.x * THREADS
    first = cuda.blockIdx.x * THREADS * UNROLL + cuda.threadIdx.x
    stride = step * UNROLL
    a = cuda.local.array(UNROLL, np.uint32)
    b = cuda.local.array(UNROLL, np.uint32)
    c = cuda.local.array(UNROLL, np.uint32)
    d = cuda.local.array(UNROLL, np.uint32)
    for base in range(first, total, stride):
        for u in range(UNROLL):  # all loads first: UNROLL requests in flight per thread
            v = base + u * THREADS
            if v < total:
                i = v // vecs
                a[u], b[u], c[u], d[u] = ld_stream_v4(src, expert[i] * words + (v - i * vecs) * 4)
        for u in range(UNROLL):
            v = base + u * THREADS
            if v < total:
                i = v // vecs
                o = slot[i] * words + (v - i * vecs) * 4
                dst[o] = a[u]
                dst[o + 1] = b[u]
                dst[o + 2] = c[u]
                dst[o + 3] = d[u]


def launch_expert_fetch(src, dst, expert, slot, count, block_bytes: int, stream=0) -> None:
    """Copies expert[i]'s block of src into slot[i] of dst for i < count[0] (module docstring)."""
    if block_bytes <= 0 or block_bytes % 16:
        raise ValueError(f"expert block of {block_bytes} bytes is not a positive multiple of 16")
    words = block_bytes // 4
    for name, a, dt in (("src", src, np.uint32), ("dst", dst, np.uint32), ("expert", expert, np.int32),
                        ("slot", slot, np.int32), ("count", count, np.int32)):
        if a.dtype != dt or a.ndim != 1 or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous 1-d {np.dtype(dt).name}, got {a.dtype} {list(a.shape)}")
    if src.shape[0] % words or dst.shape[0] % words or count.shape[0] != 1 or slot.shape[0] != expert.shape[0]:
        raise ValueError(f"src {src.shape[0]} / dst {dst.shape[0]} words are not whole blocks of {words}, or the "
                         f"lists differ ({expert.shape[0]} experts, {slot.shape[0]} slots, count {count.shape[0]})")
    if slot.shape[0] > dst.shape[0] // words:
        raise ValueError(f"a list of {slot.shape[0]} copies exceeds the {dst.shape[0] // words} slots")
    _fetch_kernel[CTAS, THREADS, stream](src, dst, expert, slot, count, np.int64(words))


def sm90_signatures():
    """(python function, numba signature) of the kernel, for the sm_90 compile check."""
    u1, i1 = types.uint32[::1], types.int32[::1]
    return [(_fetch_kernel.py_func, (u1, u1, i1, i1, i1, types.int64))]
