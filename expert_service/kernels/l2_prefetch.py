"""Warm the L2 with weights a later kernel of the step will stream: one warp hands byte ranges to the bulk-copy
unit (`ptx.prefetch_l2_bulk`, sm_90) and exits; the bytes arrive while the kernels in between run. A decode step at
one token is a chain of short kernels, each of which waits a memory latency for its first bytes and leaves the
HBM idle while it ramps up and drains; a prefetch issued a kernel or two ahead makes those reads L2 hits.

- ranges: rows of [offset, nbytes] int64 into one buffer (offsets and sizes multiples of 16): the dense
  weights a later kernel reads (an o projection, the next layer's q|k|v).
- experts: the blocks of the experts a router picked, ids [n] int32 read on the device, into experts [E, stride]
  (bytes [lo, hi) of each block: the whole block, or the down rows only). Ids outside [0, E) are skipped.
Both in one launch of one warp.

A prefetch is a hint: nothing a kernel computes depends on it, and the L2 may drop the bytes before they are read.
Reference: none needed (no output); the tests check the launches' arguments and that the kernels compile.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR, WARP, check_array, device_pointer
from expert_service.kernels.ptx import prefetch_l2_bulk

PIECE = 1 << 16  # bytes one bulk prefetch asks for: 256 of them cover a 16 MB matrix, 8 a lane


def supported() -> bool:
    """Whether this device runs the bulk prefetch (sm_90 and later; the simulator runs it as a no-op)."""
    return SIMULATOR or cuda.get_current_device().compute_capability >= (9, 0)


@cuda.jit(device=True, inline=True)
def _prefetch_span(array, start, size, lane):
    """This lane's pieces (l, l + 32, ...) of bytes [start, start + size) of a flat uint8 array."""
    for piece in range(lane * PIECE, size, WARP * PIECE):
        prefetch_l2_bulk(array, start + piece, min(PIECE, size - piece))


def _prefetch_kernel(buffer, ranges, n_ranges, experts, n_experts, stride, ids, lo, hi):
    """buffer: flat uint8; ranges [>= n_ranges, 2] int64 (offset, nbytes) into it (nbytes 0: none); experts: a
    flat uint8 [E * stride] buffer; ids [n] int32: bytes [lo, hi) of each picked block (first: a router's picks are
    read soonest), then the ranges. One warp: lane l issues pieces l, l + 32, ... of each."""
    lane = cuda.threadIdx.x
    size = hi - lo
    for j in range(ids.shape[0]):
        e = ids[j]
        if 0 <= e < n_experts:
            _prefetch_span(experts, np.int64(e) * stride + lo, size, lane)
    for r in range(n_ranges):
        _prefetch_span(buffer, ranges[r, 0], ranges[r, 1], lane)


_prefetch = cached_jit(_prefetch_kernel)


def _flat_bytes(name: str, array):
    """A C-contiguous, 16-byte aligned device array as flat uint8 (the same memory): the ranges are checked as
    offsets from its start, and the bulk prefetch faults on an address that is not a multiple of 16."""
    if not array.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")
    if (address := device_pointer(array)) % 16:
        raise ValueError(f"{name} starts at {address:#x}, not a multiple of 16 bytes (a view into an allocation?)")
    flat = array.reshape(array.size)
    return flat if np.dtype(flat.dtype) == np.uint8 else flat.view(np.uint8)


def check_ranges(ranges, buffer_bytes: int) -> np.ndarray:
    """ranges as int64 [n >= 1, 2] (offset, nbytes), checked: 16-byte aligned, non-empty, inside a buffer of
    buffer_bytes."""
    table = np.asarray(ranges, np.int64).reshape(-1, 2)
    if not len(table):
        raise ValueError("a prefetch table needs at least one range")
    for offset, size in table:
        if offset % 16 or size % 16 or size <= 0 or offset < 0 or offset + size > buffer_bytes:
            raise ValueError(f"prefetch range [{offset}, +{size}) of a {buffer_bytes}-byte buffer: offsets and "
                             "sizes are positive multiples of 16 inside it")
    return table


def launch_prefetch(buffer, ranges, experts=None, ids=None, lo: int = 0, hi: int = 0, stream=0) -> None:
    """Prefetch into L2 the `ranges` [n, 2] int64 device table (check_ranges; a row [0, 0] prefetches nothing) of
    `buffer` (any C-contiguous device array starting on a 16-byte boundary, taken as its bytes), and, given
    `experts` (device [E, stride] of any dtype, a row a block, also 16-byte aligned), bytes [lo, hi) (multiples of
    16) of the blocks that `ids` (int32 device array of any shape, read on the device; ids outside [0, E) skipped)
    names. One launch of one warp; nothing allocated, so a graph capture may hold it."""
    flat = _flat_bytes("buffer", buffer)
    check_array("ranges", ranges, (ranges.shape[0], 2), np.int64)
    if experts is None:
        if ids is not None:
            raise ValueError("ids without experts: give the expert buffer the ids index")
        # no picks: the kernel's expert loop reads the ranges' words as ids against E = 0 and skips them all
        blocks, n_experts, stride, picks = flat, 0, 0, ranges.reshape(ranges.size).view(np.int32)
    else:
        if experts.ndim != 2:
            raise ValueError(f"experts must be [E, stride] (a block a row), got {list(experts.shape)}")
        blocks = _flat_bytes("experts", experts)
        n_experts, stride = experts.shape[0], blocks.size // experts.shape[0]
        if stride % 16 or lo % 16 or hi % 16 or not 0 <= lo < hi <= stride:
            raise ValueError(f"expert bytes [{lo}, {hi}) of {stride}-byte blocks: multiples of 16 within a block")
        if ids is None:
            raise ValueError("experts without ids: give the router's picks")
        picks = ids.reshape(ids.size)
        check_array("ids", picks, (ids.size,), np.int32)
    _prefetch[1, WARP, stream](flat, ranges, np.int64(ranges.shape[0]), blocks, np.int64(n_experts), np.int64(stride),
                               picks, np.int64(lo), np.int64(hi))


def sm90_signatures():
    """(python function, numba signature) of the kernel for the sm_90 compile check."""
    i64, u8 = types.int64, types.uint8[::1]
    return [(_prefetch_kernel, (u8, types.int64[:, ::1], i64, u8, i64, i64, types.int32[::1], i64, i64))]
