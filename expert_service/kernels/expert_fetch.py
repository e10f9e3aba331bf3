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

Demand copies first: a demand copy and a speculative one (a prefetch) running at once share the link about
evenly, so a miss the step is waiting for took twice its time while a prediction was copied beside it (H100,
trained 32-expert model: 94 us for one 2.36 MB block beside a prefetch, 50 us alone). With `active` given, a
DEMAND launch counts its working CTAs in active[0] while they copy, and a SPECULATIVE launch's CTAs wait
(nanosleep) before each chunk of loads while active[0] > 0. The wait cannot deadlock: only CTAs already copying
are counted, and a counted CTA waits on nothing (a DEMAND kernel must never wait inside itself), so each ends and
the count falls to 0 whatever the streams order; a demand launch queued behind a prefetch (a layer's demand copies
follow that layer's joined prefetches) counts nothing until it runs. Without `active` (PLAIN) neither happens.

  src [E * words] uint32   the layer's experts as the model stores them (mapped host memory; words = block / 4)
  dst [S * words] uint32   the layer's slot buffer
  expert, slot [>= c] int32, count [1] int32: copy expert[i] into slot[i] for i < count[0]
  active [1] int32         demand copies' CTAs now copying (DEMAND adds and removes its own, SPECULATIVE waits
                           for 0); the same buffer for every layer of an engine
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


PLAIN, DEMAND, SPECULATIVE = 0, 1, 2  # the kernel's role towards the others (module docstring)
PAUSE_NS = 500  # a waiting CTA's sleep between looks at the demand count: ~1 % of one block's copy


def _build(role: int):
    announce, waits = role == DEMAND, role == SPECULATIVE

    def fetch_kernel(src, dst, expert, slot, count, words, active):
        """Module docstring; words: uint32 words per expert block (a multiple of 4)."""
        n = count[0]
        tid = cuda.threadIdx.x
        vecs = words // 4  # 16-byte vectors per block
        total = n * vecs
        stride = cuda.gridDim.x * THREADS * UNROLL
        if announce and n > 0 and tid == 0:
            cuda.atomic.add(active, 0, 1)
        a = cuda.local.array(UNROLL, np.uint32)
        b = cuda.local.array(UNROLL, np.uint32)
        c = cuda.local.array(UNROLL, np.uint32)
        d = cuda.local.array(UNROLL, np.uint32)
        # the loop runs over the CTA's chunks, the same count for each of its threads (the wait syncs them)
        for chunk in range(cuda.blockIdx.x * THREADS * UNROLL, total, stride):
            if waits:
                if tid == 0:
                    while cuda.atomic.add(active, 0, 0) > 0:  # an atomic read: another kernel writes it
                        if not SIMULATOR:  # the simulator runs one kernel at a time: the count is 0 here
                            cuda.nanosleep(PAUSE_NS)
                cuda.syncthreads()
            base = chunk + tid
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
        if announce and n > 0:
            cuda.syncthreads()  # every load of the CTA has landed (its stores used them): its link use is over
            if tid == 0:
                cuda.atomic.add(active, 0, -1)

    return cached_jit(fetch_kernel)


_KERNELS = {role: _build(role) for role in (PLAIN, DEMAND, SPECULATIVE)}


def launch_expert_fetch(
    src, dst, expert, slot, count, block_bytes: int, stream=0, active=None, speculative: bool = False
) -> None:
    """Copies expert[i]'s block of src into slot[i] of dst for i < count[0] (module docstring). active: the
    engine's demand count [1] int32 (None: PLAIN); speculative: a prefetch, which waits for demand copies."""
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
    if active is not None and (active.dtype != np.int32 or active.shape != (1,)):
        raise ValueError(f"active must be int32 [1], got {active.dtype} {list(active.shape)}")
    role = PLAIN if active is None else SPECULATIVE if speculative else DEMAND
    if active is None:
        active = count  # unread by PLAIN: any int32 array of the right kind
    _KERNELS[role][CTAS, THREADS, stream](src, dst, expert, slot, count, np.int64(words), active)


def sm90_signatures():
    """(python function, numba signature) of the kernel, for the sm_90 compile check."""
    u1, i1 = types.uint32[::1], types.int32[::1]
    return [(kernel.py_func, (u1, u1, i1, i1, i1, types.int64, i1)) for kernel in _KERNELS.values()]
