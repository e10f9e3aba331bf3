"""Paged decode attention for bf16 KV pools with key tiles staged in shared memory by cp.async: the same
operation, arguments and split-K partials as kernels.attention_decode (whose reduce kernel merges the parts);
`launch_attention_decode_fastest` picks this kernel where it applies (`supports`) and attention_decode otherwise.

Design (block = (sequence, GT query heads of one kv head, split), 4 warps; every K/V byte of a (sequence, kv head)
read once from HBM):
- Tiles of KT = 32 keys go global -> shared with 16-byte `cp.async` copies, two stages: tile n + 1 is in flight
  while tile n is computed, and the block-table reads for tile n + 2 are issued then too (a thread's copies need
  them one tile later). Rows stay bf16; each 16-byte chunk c of key row r sits at chunk c ^ (r % 8), so the score
  loop's 32 lanes (one key each) and the P @ V loop's 32 lanes (one column pair each) hit distinct banks.
- Scores: warp w takes heads w and w + 4, lane j key j; the dot product runs over the row's chunks with the
  query (scaled, float32) read from shared memory as a broadcast. The online softmax is a warp reduction per
  head (max, sum); probabilities go to shared memory.
- P @ V: a thread owns one pair of adjacent head dims for up to 4 heads, float32 accumulators in registers.
Every loop that indexes a per-thread array has a small compile-time trip count (it unrolls, so the arrays stay in
registers); a per-thread array indexed in a rolled loop becomes select chains or local memory, which made an
earlier tiled variant 2-4x slower than attention_decode.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.attention_decode import (
    MIN_PART_KEYS,
    NEG_INF,
    check_arguments,
    group_tile,
    launch_attention_decode,
    part_range,
    reduce_parts,
    row_lookup,
)
from expert_service.kernels.numeric import WARP, u32_as_f32, warp_max, warp_sum
from expert_service.kernels.ptx import cp_async16, cp_async_commit, cp_async_wait_fn

WARPS = 4
THREADS = WARPS * WARP
KT = 32                       # keys per tile: one per lane in the score loop
HEAD_DIMS = (64, 128)         # 16-byte chunks per row >= 8 (the swizzle) and two K + V stages within 48 KB
_HI16 = np.uint32(0xFFFF0000)


def supports(kv_dtype, head_dim: int, block_size: int) -> bool:
    """Whether launch_attention_decode_fastest runs this kernel: bf16 pools, Hd 64 or 128, power-of-two blocks."""
    return np.dtype(kv_dtype) == np.uint16 and head_dim in HEAD_DIMS and block_size & (block_size - 1) == 0


_u = np.uint32               # kernel index arithmetic stays unsigned: no negative-index wraparound code


@cuda.jit(device=True, inline=True)
def _dot8(sq, o, x0, x1, x2, x3, x4, x5, x6, x7):
    """The two halves of sq[o .. o+7] . (x0 .. x7) (two independent sums for the caller's two chains)."""
    return (sq[o] * x0 + sq[o + _u(1)] * x1 + sq[o + _u(2)] * x2 + sq[o + _u(3)] * x3,
            sq[o + _u(4)] * x4 + sq[o + _u(5)] * x5 + sq[o + _u(6)] * x6 + sq[o + _u(7)] * x7)


@functools.cache
def _build(head_dim: int, gt: int, mode: int = 0):
    chunks = head_dim // 8                 # 16-byte chunks per key row
    prologue = programmatic.prologue(mode)    # kernels/programmatic.py
    row_u64 = head_dim // 4
    tile_u64 = KT * row_u64
    copies = KT * chunks // THREADS        # 16-byte copies per thread per tile and matrix
    row_step = THREADS // chunks           # rows between a thread's copies
    cols = head_dim // 2                   # bf16 pairs per row
    col_groups = THREADS // cols           # threads per column pair, each with its own heads
    hpt = -(-gt // col_groups)             # heads per thread in P @ V
    rounds = -(-gt // WARPS)               # heads per warp in the scores (1 or 2)
    # head rows padded so no index needs clamping: rows past gt hold garbage nobody stores
    heads = max(gt, rounds * WARPS, hpt * col_groups)
    stage_len, q_len, p_len = 2 * tile_u64, heads * head_dim, heads * KT    # shared sizes: closure constants
    wait_one = cp_async_wait_fn(1)

    lookup = row_lookup(copies, row_step)

    @cuda.jit(device=True, inline=True)
    def issue(ks, vs, k_words, v_words, stage, offs, r0, chunk):
        """This thread's 16-byte copies of a tile into a stage (zeros for rows past the part)."""
        for i in range(copies):
            r = r0 + _u(i * row_step)
            dst = stage * _u(tile_u64) + r * _u(row_u64) + ((chunk ^ (r & _u(7))) << _u(1))
            ok = offs[i] >= 0
            src = offs[i] + 4 * np.int64(chunk) if ok else np.int64(0)
            cp_async16(ks, dst, k_words, src, ok)
            cp_async16(vs, dst, v_words, src, ok)

    def attention_decode_tiled_kernel(q, k_words, v_words, block_tables, context_lens, positions, block_shift,
                                      num_kv_heads, window, scale, min_keys, out, part_out, part_ml):
        """attention_decode_kernel's arguments, with the pools as flat uint32 words (two bf16 each) and the
        block size as its log2: q: [S, H, Hd] float32; k_words, v_words: [NB * BS * Hkv * Hd / 2] uint32;
        block_tables [S, max_blocks], context_lens [S], positions [S] int32; block_shift, num_kv_heads,
        window: int32; scale: float32; out [S, H, Hd] float32 (when gridDim.z == 1); part_out [S, H, P, Hd],
        part_ml [S, H, P, 2] float32. Grid (S, H // GT, P), block (THREADS,)."""
        prologue()
        s = cuda.blockIdx.x
        h0 = cuda.blockIdx.y * gt
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        kvh = h0 // (q.shape[1] // num_kv_heads)
        tid = _u(cuda.threadIdx.x)
        warp = tid >> _u(5)
        lane = tid & _u(31)
        k_lo, k_hi, parts = part_range(context_lens[s], positions[s], window, split, num_splits, min_keys)
        if split >= max(parts, 1):   # the whole block: a part this sequence's keys do not need
            return
        n_tiles = (max(k_hi - k_lo, 0) + KT - 1) // KT

        ks = cuda.shared.array(stage_len, types.uint64)
        vs = cuda.shared.array(stage_len, types.uint64)
        sq = cuda.shared.array(q_len, types.float32)
        sp = cuda.shared.array(p_len, types.float32)     # probabilities [heads, KT]
        sm = cuda.shared.array(heads, types.float32)     # running max per head
        sl = cuda.shared.array(heads, types.float32)     # running sum per head
        sa = cuda.shared.array(heads, types.float32)     # this tile's rescale of the accumulators
        for e in range(tid, gt * head_dim, THREADS):
            sq[e] = q[s, h0 + e // head_dim, e % head_dim] * scale
        if tid < _u(heads):
            sm[tid] = NEG_INF
            sl[tid] = 0.0

        row_words = np.int64(num_kv_heads * (head_dim // 2))
        head_word = np.int64(kvh * (head_dim // 2))
        r0 = tid // _u(chunks)
        chunk = tid % _u(chunks)
        offs = cuda.local.array(copies, types.int64)
        lookup(block_tables, s, k_lo, k_hi, block_shift, row_words, head_word, r0, offs)
        if n_tiles > 0:
            issue(ks, vs, k_words, v_words, _u(0), offs, r0, chunk)
        cp_async_commit()
        lookup(block_tables, s, k_lo + KT, k_hi, block_shift, row_words, head_word, r0, offs)

        # scores: lane = key of the tile, heads warp and warp + WARPS
        swz = lane & _u(7)
        qa = warp * _u(head_dim)
        qb = (warp + _u(WARPS)) * _u(head_dim)
        # P @ V: column pair col of V (its u64 word and half), heads hgrp + i * col_groups
        col = tid % _u(cols)
        hgrp = tid // _u(cols)
        col_chunk = col >> _u(2)
        col_word = (col & _u(3)) >> _u(1)
        shift = np.uint64(32) * np.uint64(col & _u(1))
        acc_lo = cuda.local.array(hpt, types.float32)
        acc_hi = cuda.local.array(hpt, types.float32)
        for i in range(hpt):
            acc_lo[i] = 0.0
            acc_hi[i] = 0.0

        for n in range(n_tiles):
            t0 = k_lo + n * KT
            stage = _u(n & 1)
            if n + 1 < n_tiles:
                issue(ks, vs, k_words, v_words, _u(1) - stage, offs, r0, chunk)
            cp_async_commit()
            lookup(block_tables, s, t0 + 2 * KT, k_hi, block_shift, row_words, head_word, r0, offs)
            wait_one()                        # this thread's copies of tile n have landed
            cuda.syncthreads()                # everyone's have

            kbase = stage * _u(tile_u64) + lane * _u(row_u64)
            a0 = a1 = b0 = b1 = np.float32(0.0)
            for c in range(chunks):
                cu = _u(c)
                at = kbase + ((cu ^ swz) << _u(1))
                w0 = ks[at]
                w1 = ks[at + _u(1)]
                x0 = u32_as_f32(np.uint32(w0) << _u(16))
                x1 = u32_as_f32(np.uint32(w0) & _HI16)
                x2 = u32_as_f32(np.uint32(w0 >> np.uint64(32)) << _u(16))
                x3 = u32_as_f32(np.uint32(w0 >> np.uint64(32)) & _HI16)
                x4 = u32_as_f32(np.uint32(w1) << _u(16))
                x5 = u32_as_f32(np.uint32(w1) & _HI16)
                x6 = u32_as_f32(np.uint32(w1 >> np.uint64(32)) << _u(16))
                x7 = u32_as_f32(np.uint32(w1 >> np.uint64(32)) & _HI16)
                lo, hi = _dot8(sq, qa + (cu << _u(3)), x0, x1, x2, x3, x4, x5, x6, x7)
                a0 += lo
                a1 += hi
                if rounds == 2:
                    lo, hi = _dot8(sq, qb + (cu << _u(3)), x0, x1, x2, x3, x4, x5, x6, x7)
                    b0 += lo
                    b1 += hi
            in_range = t0 + np.int32(lane) < k_hi
            for r in range(rounds):           # every warp joins every round's shuffles
                g = warp + _u(r * WARPS)
                score = (a0 + a1 if r == 0 else b0 + b1) if in_range else NEG_INF
                m_old = sm[g]
                m_new = max(m_old, warp_max(score))      # finite: the tile's first key is in range
                p = math.exp(score - m_new) if in_range else np.float32(0.0)
                total = warp_sum(p)
                if g < _u(gt):
                    sp[g * _u(KT) + lane] = p
                    if lane == _u(0):
                        alpha = math.exp(m_old - m_new) if m_old > NEG_INF else np.float32(0.0)
                        sa[g] = alpha
                        sl[g] = sl[g] * alpha + total
                        sm[g] = m_new
            cuda.syncthreads()

            for i in range(hpt):
                alpha = sa[hgrp + _u(i * col_groups)]
                acc_lo[i] *= alpha
                acc_hi[i] *= alpha
            vbase = stage * _u(tile_u64) + col_word
            pbase = hgrp * _u(KT)
            for j in range(KT):
                ju = _u(j)
                w = vs[vbase + ju * _u(row_u64) + ((col_chunk ^ (ju & _u(7))) << _u(1))]
                bits = np.uint32(w >> shift)
                v_lo = u32_as_f32(bits << _u(16))
                v_hi = u32_as_f32(bits & _HI16)
                for i in range(hpt):
                    p = sp[pbase + _u(i * col_groups * KT) + ju]
                    acc_lo[i] += p * v_lo
                    acc_hi[i] += p * v_hi
            cuda.syncthreads()                # the stage and sp are free for the next tiles

        for i in range(hpt):
            g = hgrp + _u(i * col_groups)
            if g < _u(gt):
                d = _u(2) * col
                if parts <= 1:
                    # no tiles (an idle slot): no barrier ordered sl's initialisation before this read
                    inv = np.float32(1.0) / sl[g] if n_tiles > 0 and sl[g] > 0 else np.float32(0.0)
                    out[s, h0 + g, d] = acc_lo[i] * inv
                    out[s, h0 + g, d + _u(1)] = acc_hi[i] * inv
                else:
                    part_out[s, h0 + g, split, d] = acc_lo[i]
                    part_out[s, h0 + g, split, d + _u(1)] = acc_hi[i]
                    if col == _u(0):
                        part_ml[s, h0 + g, split, 0] = sm[g]
                        part_ml[s, h0 + g, split, 1] = sl[g]

    return attention_decode_tiled_kernel, programmatic.compiled(attention_decode_tiled_kernel, mode)


def launch_attention_decode_tiled(q, k_pool, v_pool, block_tables, context_lens, positions, window: int,
                                  scale: float, out, part_out=None, part_ml=None, stream=0,
                                  min_keys: int = MIN_PART_KEYS) -> None:
    """launch_attention_decode's arguments (min_keys: the fewest keys of a part); k_pool, v_pool: [NB, BS, Hkv, Hd]
    uint16 (bf16 bits), Hd 64 or 128."""
    num_seqs, num_heads, head_dim, num_kv_heads, block_size, splits = check_arguments(
        "attention_decode_tiled", q, k_pool, v_pool, block_tables, context_lens, positions, out, part_out, part_ml)
    assert supports(k_pool.dtype, head_dim, block_size), (k_pool.dtype, head_dim, block_size)
    if num_seqs == 0:
        return
    gt = group_tile(num_heads // num_kv_heads)
    kernel = _build(head_dim, gt, programmatic.mode())[1]
    if splits == 1:
        part_out = part_ml = out.reshape(num_seqs, num_heads, 1, head_dim)
    kernel[(num_seqs, num_heads // gt, splits), THREADS, stream](
        q, k_pool.reshape(-1).view(np.uint32), v_pool.reshape(-1).view(np.uint32), block_tables, context_lens,
        positions, np.int32(block_size.bit_length() - 1), np.int32(num_kv_heads), np.int32(window),
        np.float32(scale), np.int32(min_keys), out, part_out, part_ml)
    if splits > 1:
        reduce_parts(context_lens, positions, window, min_keys, part_out, part_ml, out, stream)


def launch_attention_decode_fastest(q, k_pool, v_pool, block_tables, context_lens, positions, window: int,
                                    scale: float, out, part_out=None, part_ml=None, stream=0,
                                    min_keys: int = MIN_PART_KEYS) -> None:
    """launch_attention_decode's arguments: this kernel where `supports` holds, attention_decode otherwise."""
    tiled = supports(k_pool.dtype, q.shape[2], k_pool.shape[1])
    launch = launch_attention_decode_tiled if tiled else launch_attention_decode
    launch(q, k_pool, v_pool, block_tables, context_lens, positions, window, scale, out, part_out, part_ml, stream,
           min_keys=min_keys)


def sm90_signatures():
    """(python function, numba signature): Hd 128 with GQA tiles 4 and 8 (8 also waiting), Hd 64 with tile 1
    (MHA)."""
    f32_3d, f32_4d, i32, u32 = types.float32[:, :, ::1], types.float32[:, :, :, ::1], types.int32, types.uint32[::1]
    sig = (f32_3d, u32, u32, i32[:, ::1], i32[::1], i32[::1], i32, i32, i32, types.float32, i32, f32_3d, f32_4d,
           f32_4d)
    return [(_build(hd, gt, wait)[0], sig) for hd, gt, wait in ((128, 4, False), (128, 8, False), (128, 8, True), (64, 1, False))]
