"""Tokens sorted by expert and padded to the grouped GEMM's M tile, on the device (vLLM's moe_align_block_size):
the layout `moe_gemm_mma` reads. Nothing goes back to the host, so the MoE block stays graph-capturable.

launch_moe_align(ids, block_m, ...) -- one block, one launch (the counting sort of `expert_grouping`, padded):
  counts per expert (shared atomics), padded counts ceil(c_e / BM) * BM, exclusive scan -> each expert's first
  padded row; every (token, slot) assignment a = t*K + k gets a row of its expert's range:
    sorted_ids [rows]     assignment index in each used padded row, -1 in padding rows
    tile_expert [tiles]   expert of each M tile (rows tile*BM .. +BM), -1 for tiles past the used count
    num_tiles [1]         used tiles (the GEMM's grid is sized from max_tiles() and tiles past this exit)
    position [T*K]        padded row of each assignment (-1 for an id outside [0, E), which is dropped)
  Rows past num_tiles * BM are not written. Order within an expert follows atomic arrival (not stable); every
  row's result is independent of it.
launch_moe_gather_bf16(x, sorted_ids, num_tiles, top_k, block_m, xs) -- the GEMM's A operand: xs[r] =
  bf16(x[sorted_ids[r] // K]) (round to nearest even), zeros in padding rows; rows past the used ones exit.
  A block per row. When D % 4 == 0 (and x, xs 8-byte aligned) a thread converts GATHER_WORDS words of 4 floats
  at once: all their 8-byte loads in flight, then one 8-byte store of 4 bf16 per word. Other widths take one
  element per step, a 2-byte store each, each step's load waiting for the previous step's store.

Reference: `moe_align_reference` (numpy), which the tests compare with (per expert as sets).
Why one block: as expert_grouping (T*K <= 65536 is a few passes over shared memory on one SM; a multi-block
sort needs a zeroing launch and a grid barrier).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import SIMULATOR, aligned_to, f32_to_bf16, packer4

MAX_E = 256
_STARTS = MAX_E + 1                     # shared array sizes must be plain constants
MAX_ASSIGNMENTS = 1 << 20
THREADS = 64 if SIMULATOR else 1024     # the simulator runs a Python thread per CUDA thread; same code path
_SCAN_SLOTS = 1024                      # >= THREADS
GATHER_THREADS = 32 if SIMULATOR else 256
# D % 4 == 0: a thread converts GATHER_WORDS words of 4 floats at once (8 loads in flight), so D = 2048 is one
# step of 128 threads and 16 rows' blocks fit an SM: a row's memory round trips overlap other rows'.
GATHER_WORDS = 4
GATHER_WORD_THREADS = 32 if SIMULATOR else 128


def max_tiles(n_assignments: int, n_experts: int, block_m: int) -> int:
    """Upper bound of the used M tiles: sum_e ceil(c_e / BM) <= floor(n / BM) + (experts with tokens)."""
    return n_assignments // block_m + min(n_experts, n_assignments)


def max_rows(n_assignments: int, n_experts: int, block_m: int) -> int:
    """Rows of sorted_ids / xs / h: max_tiles * BM."""
    return max_tiles(n_assignments, n_experts, block_m) * block_m


@cached_jit
def _moe_align_kernel(ids, n_exp, block_m, sorted_ids, tile_expert, num_tiles, position):
    """ids [T, K] int32; n_exp, block_m int32 -> sorted_ids [rows], tile_expert [tiles], num_tiles [1],
    position [T*K] (int32). One block of THREADS threads."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    top_k = ids.shape[1]
    n = ids.shape[0] * top_k
    hist = cuda.shared.array(MAX_E, np.int32)
    start = cuda.shared.array(_STARTS, np.int32)
    cursor = cuda.shared.array(MAX_E, np.int32)
    partial = cuda.shared.array(_SCAN_SLOTS, np.int32)

    for e in range(tid, n_exp, nthreads):
        hist[e] = 0
    cuda.syncthreads()
    for i in range(tid, n, nthreads):
        e = ids[i // top_k, i % top_k]
        if 0 <= e < n_exp:
            cuda.atomic.add(hist, e, 1)
    cuda.syncthreads()

    # Exclusive scan of the padded counts: a chunk of experts per thread, Hillis-Steele over the chunk totals.
    chunk = (n_exp + nthreads - 1) // nthreads
    lo = min(tid * chunk, n_exp)
    hi = min(lo + chunk, n_exp)
    own = 0
    for e in range(lo, hi):
        own += (hist[e] + block_m - 1) // block_m * block_m
    partial[tid] = own
    cuda.syncthreads()
    step = 1
    while step < nthreads:
        v = partial[tid - step] if tid >= step else 0
        cuda.syncthreads()
        partial[tid] += v
        cuda.syncthreads()
        step *= 2
    run = partial[tid] - own
    for e in range(lo, hi):
        start[e] = run
        cursor[e] = run
        run += (hist[e] + block_m - 1) // block_m * block_m
    if tid == nthreads - 1:
        start[n_exp] = partial[tid]
        num_tiles[0] = partial[tid] // block_m
    cuda.syncthreads()

    used = start[n_exp] // block_m
    for i in range(tid, tile_expert.shape[0], nthreads):
        if i < used:
            # the last expert whose range starts at or before row i*BM (empty experts share its start)
            row = i * block_m
            a = 0
            b = n_exp - 1
            while a < b:
                mid = (a + b + 1) // 2
                if start[mid] <= row:
                    a = mid
                else:
                    b = mid - 1
            tile_expert[i] = a
        else:
            tile_expert[i] = -1
    for e in range(tid, n_exp, nthreads):
        for r in range(start[e] + hist[e], start[e + 1]):
            sorted_ids[r] = -1
    for i in range(tid, n, nthreads):
        e = ids[i // top_k, i % top_k]
        if 0 <= e < n_exp:
            p = cuda.atomic.add(cursor, e, 1)
            sorted_ids[p] = i
            position[i] = p
        else:
            position[i] = -1


def launch_moe_align(ids, n_exp: int, block_m: int, sorted_ids, tile_expert, num_tiles, position, stream=0) -> None:
    """ids [T, K] int32 (device); writes sorted_ids [max_rows], tile_expert [max_tiles], num_tiles [1],
    position [T*K] (int32, device; sizes from max_tiles / max_rows of T*K, E, block_m)."""
    n_tok, top_k = ids.shape
    n = n_tok * top_k
    if not 1 <= n_exp <= MAX_E or n > MAX_ASSIGNMENTS or block_m < 1:
        raise ValueError(f"moe_align supports E <= {MAX_E}, T*K <= {MAX_ASSIGNMENTS}, got E={n_exp} T*K={n} "
                         f"BM={block_m}")
    tiles = max_tiles(n, n_exp, block_m)
    expected = {"ids": (n_tok, top_k), "sorted_ids": (tiles * block_m,), "tile_expert": (tiles,),
                "num_tiles": (1,), "position": (n,)}
    for name, a in (("ids", ids), ("sorted_ids", sorted_ids), ("tile_expert", tile_expert),
                    ("num_tiles", num_tiles), ("position", position)):
        if a.shape != expected[name] or a.dtype != np.int32 or not a.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{name} must be C-contiguous int32 {list(expected[name])}, got {a.dtype} {list(a.shape)}")
    _moe_align_kernel[1, THREADS, stream](ids, np.int32(n_exp), np.int32(block_m), sorted_ids, tile_expert,
                                          num_tiles, position)


@cached_jit
def _gather_bf16_kernel(x, sorted_ids, num_tiles, top_k, block_m, xs):
    """Any D. x [T, D] f32, sorted_ids [rows] int32, num_tiles [1] -> xs [rows, D] uint16 (bf16 bits).
    Grid (rows,), block (GATHER_THREADS,)."""
    r = cuda.blockIdx.x
    if r >= num_tiles[0] * block_m:
        return
    a = sorted_ids[r]
    width = xs.shape[1]
    if a < 0:
        for d in range(cuda.threadIdx.x, width, cuda.blockDim.x):
            xs[r, d] = np.uint16(0)
        return
    t = a // top_k
    for d in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        xs[r, d] = f32_to_bf16(x[t, d])


_pack_bf16x4 = packer4(np.uint16)


@cached_jit
def _gather_bf16_words_kernel(x2, sorted_ids, num_tiles, top_k, block_m, xs4):
    """D % 4 == 0. x2 [T, D/2] uint64 (x's float32 pairs), sorted_ids [rows] int32, num_tiles [1] -> xs4
    [rows, D/4] uint64 (words of 4 bf16, the first element in the low bits). Grid (rows,), block
    (GATHER_WORD_THREADS,): thread i converts words i, i + blockDim, ... (GATHER_WORDS of them) at once."""
    r = cuda.blockIdx.x
    if r >= num_tiles[0] * block_m:
        return
    a = sorted_ids[r]
    words = xs4.shape[1]
    step = cuda.blockDim.x
    if a < 0:
        for q in range(cuda.threadIdx.x, words, step):
            xs4[r, q] = np.uint64(0)
        return
    t = a // top_k
    lo = cuda.local.array(GATHER_WORDS, np.uint64)
    hi = cuda.local.array(GATHER_WORDS, np.uint64)
    for base in range(cuda.threadIdx.x, words, GATHER_WORDS * step):
        # every load before any store: the compiler must assume xs4 may alias x2 and would not reorder them
        for j in range(GATHER_WORDS):
            q = base + j * step
            if q < words:
                lo[j], hi[j] = x2[t, 2 * q], x2[t, 2 * q + 1]
        for j in range(GATHER_WORDS):
            q = base + j * step
            if q < words:
                xs4[r, q] = _pack_bf16x4(lo[j], hi[j])


def launch_moe_gather_bf16(x, sorted_ids, num_tiles, top_k: int, block_m: int, xs, stream=0) -> None:
    """x [T, D] f32; sorted_ids [rows] int32 and num_tiles [1] int32 from launch_moe_align; xs [rows, D] uint16
    written in the used rows (bf16 of each row's token, zeros in padding rows)."""
    rows = sorted_ids.shape[0]
    if (x.ndim != 2 or x.dtype != np.float32 or xs.shape != (rows, x.shape[1]) or xs.dtype != np.uint16
            or sorted_ids.dtype != np.int32 or num_tiles.shape != (1,) or rows % block_m):
        raise ValueError(f"moe_gather_bf16: x {x.shape} {x.dtype}, sorted_ids {sorted_ids.shape}, xs {xs.shape} "
                         f"{xs.dtype}, BM {block_m}")
    if not rows:
        return
    args = (sorted_ids, num_tiles, np.int32(top_k), np.int32(block_m))
    if (x.shape[1] % 4 == 0 and x.shape[0] and x.flags["C_CONTIGUOUS"] and xs.flags["C_CONTIGUOUS"]
            and aligned_to(8, x, xs)):
        _gather_bf16_words_kernel[rows, GATHER_WORD_THREADS, stream](x.view(np.uint64), *args, xs.view(np.uint64))
    else:
        _gather_bf16_kernel[rows, GATHER_THREADS, stream](x, *args, xs)


def moe_align_reference(ids: np.ndarray, n_exp: int, block_m: int):
    """numpy: (sorted_ids, tile_expert, num_tiles, position) with a stable order inside each expert and the
    same sizes as the kernel's buffers (rows past the used ones -1 here; the kernel leaves them alone)."""
    flat = ids.reshape(-1).astype(np.int64)
    n = flat.size
    tiles = max_tiles(n, n_exp, block_m)
    sorted_ids = np.full(tiles * block_m, -1, np.int32)
    tile_expert = np.full(tiles, -1, np.int32)
    position = np.full(n, -1, np.int32)
    row = 0
    for e in range(n_exp):
        members = np.flatnonzero(flat == e)
        if members.size == 0:
            continue
        sorted_ids[row:row + members.size] = members
        position[members] = row + np.arange(members.size)
        used = -(-members.size // block_m)
        tile_expert[row // block_m:row // block_m + used] = e
        row += used * block_m
    return sorted_ids, tile_expert, np.array([row // block_m], np.int32), position


def sm90_signatures():
    """(python function, numba signature) of every kernel, for the sm_90 compile check."""
    i1, i32 = types.int32[::1], types.int32
    return [(_moe_align_kernel.py_func, (types.int32[:, ::1], i32, i32, i1, i1, i1, i1)),
            (_gather_bf16_kernel.py_func, (types.float32[:, ::1], i1, i1, i32, i32, types.uint16[:, ::1])),
            (_gather_bf16_words_kernel.py_func, (types.uint64[:, ::1], i1, i1, i32, i32, types.uint64[:, ::1]))]
