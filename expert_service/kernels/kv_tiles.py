"""Key/value tiles of a paged bf16 KV pool staged into shared memory by `cp.async`, the pipeline both tensor-core
attention kernels run (attention_decode_mma, attention_prefill_mma).

A tile is KT consecutive keys of one sequence and kv head: KT rows of K and KT rows of V, each row Hd bf16 values
(Hd / 8 chunks of 16 bytes) in their pool layout, so no value passes through registers. Every thread copies
`copies` chunks of K and as many of V a tile: chunk `tid % chunks` of rows `tid // chunks + i * row_step`.
Rows are XOR-swizzled per chunk so the mma fragment loads are free of bank conflicts: chunk c of K row r sits at
chunk c ^ (2 (r % 4) & swz), of V row r at c ^ (2 ((r / 2) % 4) & swz), swz = (chunks - 1) & ~1 flipping chunk
bits 1-2 only (a chunk stays in its row; Hd 16, whose rows are 2 chunks, is not swizzled).
STAGES tiles live in shared memory: K at word stage * tile_u64 of a uint64 array, V at stage * tile_u32 of a
uint32 array, both declared with alignment=STAGE_ALIGN; `prime` puts the first STAGES - 1 tiles in flight,
`advance` issues the next one into the stage the previous iteration used, waits for tile `it` and returns its
stage; the caller ends each iteration with a block barrier (every warp is done with the stage before it is
refilled).
`pv_product` is the P V step both kernels run on a staged V tile: B = V[key][d] needs two keys a register, so a
lane loads the 32-bit words (d = 2m, 2m + 1; m = 8c + g) of keys 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-key k-step
and `prmt` pairs their low halves into the B fragment of column 2m and their high halves into that of 2m + 1 (the
n index is permuted: n-tiles of even and of odd head dims), so a lane ends with head dims 16c + 4t .. +3 of its
rows: accumulators acc[8c .. 8c + 3] (even dims) and acc[8c + 4 .. 8c + 7] (odd dims) in mma C order.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda

from expert_service.kernels.attention_decode import row_lookup
from expert_service.kernels.mma import block_mma as mma
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn, ld_shared, prmt_fn

ZERO = np.float32(0.0)
# cp.async writes 16-byte chunks: the stage arrays are declared with this alignment (Numba aligns a shared array to
# its element size otherwise, so a neighbouring array of odd size could misalign them). The simulator rejects any.
STAGE_ALIGN = None if SIMULATOR else 16


class TileLayout(NamedTuple):
    """Sizes of one tile of KT keys at head size Hd staged by `threads` threads."""

    chunks: int     # 16-byte chunks a key row
    row_u64: int    # uint64 words a row
    row_u32: int    # uint32 words a row
    tile_u64: int   # uint64 words a tile of K (or V)
    tile_u32: int   # uint32 words a tile
    copies: int     # 16-byte copies a thread a tile, of K and of V each
    row_step: int   # rows between a thread's copies
    swz: int        # the chunk bits the swizzles flip


def swizzle_bits(head_dim: int) -> int:
    """The chunk-index bits the row swizzles flip: bits 1-2 within a row's Hd / 8 chunks (none at Hd 16)."""
    return (head_dim // 8 - 1) & ~1


def tile_layout(kt: int, head_dim: int, threads: int) -> TileLayout:
    chunks = head_dim // 8
    assert threads % chunks == 0 and kt * chunks % threads == 0, (kt, head_dim, threads)
    return TileLayout(chunks, head_dim // 4, head_dim // 2, kt * head_dim // 4, kt * head_dim // 2,
                      kt * chunks // threads, threads // chunks, swizzle_bits(head_dim))


@functools.cache
def tile_pipeline(kt: int, head_dim: int, threads: int, stages: int):
    """Device functions (prime, advance) of the pipeline over tiles of kt keys (module docstring):
    prime(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, n_tiles, block_shift, row_words, head_word, offs)
    advance(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, it, n_tiles, block_shift, row_words, head_word,
            offs) -> stage of tile it
    ks: uint64 and vs: uint32 shared arrays of stages tiles; k_words, v_words: uint32 views of the pools; tile n
    holds keys k_lo + n kt ..., zeros from k_hi on; offs: the thread's int64 [copies] scratch of pool offsets."""
    lay = tile_layout(kt, head_dim, threads)
    copies, row_step, swz = lay.copies, lay.row_step, lay.swz
    tile_u64, tile_u32, row_u64, row_u32, chunks = lay.tile_u64, lay.tile_u32, lay.row_u64, lay.row_u32, lay.chunks
    lookup = row_lookup(copies, row_step)
    # at tile n, stages + n groups are committed and tile n is group n: waiting until stages - 1 are pending
    # lands it and leaves the stages - 1 tiles issued after it in flight
    wait_tile = cp_async_wait_fn(stages - 1)

    @cuda.jit(device=True, inline=True)
    def issue(ks, vs, k_words, v_words, stage, offs):
        """This thread's 16-byte copies of a tile's K and V rows into a stage (zeros past the range)."""
        tid = cuda.threadIdx.x
        r0 = tid // chunks
        chunk = tid % chunks
        for i in range(copies):
            r = r0 + i * row_step
            ok = offs[i] >= 0
            src = offs[i] + 4 * np.int64(chunk) if ok else np.int64(0)
            kc = chunk ^ ((2 * (r % 4)) & swz)
            vc = chunk ^ ((2 * ((r // 2) % 4)) & swz)
            cp_async16(ks, stage * tile_u64 + r * row_u64 + 2 * kc, k_words, src, ok)
            cp_async16(vs, stage * tile_u32 + r * row_u32 + 4 * vc, v_words, src, ok)

    @cuda.jit(device=True, inline=True)
    def prime(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, n_tiles, block_shift, row_words, head_word,
              offs):
        r0 = cuda.threadIdx.x // chunks
        for pre in range(stages - 1):             # the first stages - 1 tiles in flight, one group each
            lookup(block_tables, s, k_lo + pre * kt, k_hi, block_shift, row_words, head_word, r0, offs)
            if pre < n_tiles:
                issue(ks, vs, k_words, v_words, pre, offs)
            cp_async_commit()
        lookup(block_tables, s, k_lo + (stages - 1) * kt, k_hi, block_shift, row_words, head_word, r0, offs)

    @cuda.jit(device=True, inline=True)
    def advance(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, it, n_tiles, block_shift, row_words,
                head_word, offs):
        ahead = it + stages - 1                   # the tile issued now, into the stage computed last iteration
        if ahead < n_tiles:
            issue(ks, vs, k_words, v_words, ahead % stages, offs)
        cp_async_commit()
        lookup(block_tables, s, k_lo + (ahead + 1) * kt, k_hi, block_shift, row_words, head_word,
               cuda.threadIdx.x // chunks, offs)
        wait_tile()                               # this thread's copies of tile `it` have landed
        cuda.syncthreads()                        # everyone's have
        return it % stages

    return prime, advance


@functools.cache
def pv_product(head_dim: int, rows2: bool):
    """Device function pv(vs, vrow, pa0, pa1, pa2, pa3, acc): acc += P V over one 16-key k-step of a staged V tile
    (module docstring). vs: the uint32 stages; vrow: the word of key row 2t of the k-step (stage * tile_u32 +
    (first key + 2t) * row_u32); pa0..pa3: P's A fragment (rows g, g + 8; keys 2t, 2t + 1 and 2t + 8, 2t + 9);
    acc: float32 [8 * Hd / 16]. rows2 False: the A rows g + 8 are unused, their accumulator halves stay zero (and
    the compiler drops them)."""
    nks = head_dim // 16
    row_u32 = head_dim // 2
    swz = swizzle_bits(head_dim)
    low_halves, high_halves = prmt_fn(0x5410), prmt_fn(0x7632)

    @cuda.jit(device=True, inline=True)
    def pv(vs, vrow, pa0, pa1, pa2, pa3, acc):
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        v_swz = (2 * (lane % 4)) & swz            # V rows 2t (+1, +8, +9) of a k-step: (key / 2) % 4 == t
        for c in range(nks):
            word = vrow + 4 * ((2 * c + g // 4) ^ v_swz) + g % 4   # d = 2m, 2m + 1 with m = 8c + g
            wa = ld_shared(vs, word)
            wb = ld_shared(vs, word + row_u32)
            wc = ld_shared(vs, word + 8 * row_u32)
            wd = ld_shared(vs, word + 9 * row_u32)
            acc[8 * c], acc[8 * c + 1], acc[8 * c + 2], acc[8 * c + 3] = mma(
                pa0, pa1, pa2, pa3, low_halves(wa, wb), low_halves(wc, wd), acc[8 * c], acc[8 * c + 1],
                acc[8 * c + 2] if rows2 else ZERO, acc[8 * c + 3] if rows2 else ZERO)
            acc[8 * c + 4], acc[8 * c + 5], acc[8 * c + 6], acc[8 * c + 7] = mma(
                pa0, pa1, pa2, pa3, high_halves(wa, wb), high_halves(wc, wd), acc[8 * c + 4], acc[8 * c + 5],
                acc[8 * c + 6] if rows2 else ZERO, acc[8 * c + 7] if rows2 else ZERO)

    return pv
