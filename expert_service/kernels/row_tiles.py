"""The row table of a one-matrix grouped GEMM: moe_gemm_q8mma run as a dense linear layer over a step's R rows (the
8-bit LM head and attention projections) reads its rows through moe_align's tables, here the identity:

    sorted_ids[j] = j for j < R, -1 past it (padding rows of the last tile: the epilogue drops them)
    num_tiles[0]  = ceil(R / block_m)

Written on the device by the launch, so one table as wide as the largest step serves every row count (a captured
graph replays its own count's fill) instead of a table per count, which grows with the square of the rows.
Reference: ``row_tiles_reference``.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import check_array

THREADS = 128


def row_tiles_kernel(rows, block_m, sorted_ids, num_tiles):
    """rows, block_m: int32; sorted_ids [width] int32, num_tiles [1] int32. Grid (ceil(width / THREADS),)."""
    j = cuda.grid(1)
    if j < sorted_ids.shape[0]:
        sorted_ids[j] = j if j < rows else -1
    if j == 0:
        num_tiles[0] = (rows + block_m - 1) // block_m


_row_tiles = cached_jit(row_tiles_kernel)


def launch_row_tiles(rows: int, block_m: int, sorted_ids, num_tiles, stream=0) -> None:
    """sorted_ids [width] int32 (width: rows rounded up to whole tiles of block_m), num_tiles [1] int32: both
    written, every element."""
    width = sorted_ids.shape[0] if sorted_ids.ndim == 1 else -1
    check_array("sorted_ids", sorted_ids, (width,), np.int32)
    check_array("num_tiles", num_tiles, (1,), np.int32)
    if rows < 1 or block_m < 1 or width != -(-rows // block_m) * block_m:
        raise ValueError(f"{rows} rows in tiles of {block_m}: sorted_ids must hold whole tiles, got {width} entries")
    _row_tiles[-(-width // THREADS), THREADS, stream](np.int32(rows), np.int32(block_m), sorted_ids, num_tiles)


def row_tiles_reference(rows: int, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted_ids, num_tiles) as the kernel writes them."""
    tiles = -(-rows // block_m)
    ids = np.full(tiles * block_m, -1, np.int32)
    ids[:rows] = np.arange(rows)
    return ids, np.array([tiles], np.int32)


def sm90_signatures():
    i1 = types.int32[::1]
    return [(row_tiles_kernel, (types.int32, types.int32, i1, i1))]
