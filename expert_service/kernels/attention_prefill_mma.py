"""attention_prefill on tensor cores for bf16 KV pools: the same operation and launcher signature as
kernels.attention_prefill (varlen causal attention of a step's new tokens over each sequence's paged KV cache,
chunked prefill, sliding window, GQA), with QK^T and PV on `mma.sync m16n8k16` bf16 (kernels.mma).
`launch_attention_prefill_fastest` picks this kernel when `supports` holds and the fp32 CUDA-core kernel otherwise
(fp32/fp16 pools, head sizes other than 16/32/64/128, block sizes that are not powers of two).

Design (FlashAttention-2, one warp per 16 query rows; the K/V staging and fragment loads of attention_decode_mma):
- Block = (query tile of BQ = 64 rows of one sequence, query head), 4 warps. Grid x is ceil(T / BQ) + S as in
  launch_attention_prefill; the block -> (sequence, tile) walk reads the tile counts in parallel, and a sequence's
  last (most keys) tile is launched first.
- Tiles of KT keys go global -> shared by 16-byte `cp.async` through STAGES stages (kernels.kv_tiles), rows in
  their pool layout (bf16), so the next tile's copies (and the block-table reads of the one after) are in flight
  while a tile is computed; every warp multiplies its 16 rows by the whole tile.
- q is scaled by scale * log2(e), rounded to bf16 and kept in registers as A fragments, so softmax runs in base
  2 (ex2.approx). S = Q K^T and O += P V accumulate in fp32 registers; P is rounded to bf16 and, as the C
  fragments of S, is already P V's A operand; the row sums use the fp32 p, quad shuffles give the row maxima.
- K: the k index of Q K^T is permuted so one 8-byte shared load is a lane's B fragment (head dims 16c + 4t .. +3;
  q takes the same order). V (kernels.kv_tiles.pv_product): a lane loads the 32-bit words (d = 2m, 2m + 1) of
  keys 2t, 2t + 1, 2t + 8, 2t + 9 and `prmt` pairs their low halves into the B fragment of column 2m and their high
  halves into that of 2m + 1, so a lane ends with head dims 16c + 4t .. +3 of its rows. Shared rows are
  XOR-swizzled per 16-byte chunk (K by key % 4, V by (key / 2) % 4), which makes both loads free of bank conflicts.
- Scores are masked only in tiles that cross a row's causal / window bound; a warp skips the products of tiles
  outside all its rows' ranges (its block still stages them).
Numerics: bf16 q and P give ~3e-3 relative error on outputs (vs the fp32 kernel's 1e-5 at fp32 storage).
Preconditions the launcher checks: bf16 pools, Hd 16-128 a power of two, power-of-two blocks, q / out / pools
starting on 16 bytes (16-byte loads of q, stores of out, copies of K/V). Its callers guarantee: positions ascend
within a sequence (the masks' shortcuts rely on each row's range never shrinking), q does not alias out (q is read
through the read-only path).
Under the CUDA simulator the mma, the pack and exp2 are `block_mma` / `block_pack` / `block_exp2` (an exact
emulation; every warp then computes every tile, since the emulation needs the whole block), so CI runs this kernel
on small shapes.
Not done: GQA packing (K/V are read once per query head, from L2), split-K over long prefixes, Hd = 256.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.attention_prefill import check_arguments, launch_attention_prefill
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.kv_tiles import STAGE_ALIGN, pv_product, tile_layout, tile_pipeline
from expert_service.kernels.mma import block_exp2 as exp2
from expert_service.kernels.mma import block_mma as mma
from expert_service.kernels.mma import block_pack as pack
from expert_service.kernels.numeric import SIMULATOR, aligned_to, quad_max, quad_sum
from expert_service.kernels.ptx import ld_shared, ld_v4, st_v4

WARPS = 4
THREADS = 32 * WARPS
BQ = 16 * WARPS                  # query rows per block, 16 per warp (the mma M)
HEAD_DIMS = (16, 32, 64, 128)    # powers of two of 16-byte chunks a row (the staging and the swizzles need them)
STAGES = 2                       # K/V tiles in shared memory: one in flight while one is computed (three do not
                                 # fit the 48 KB of static shared memory at Hd 128 beside the tile walk's arrays)
LOG2E = 1.4426950408889634
NEG_INF = np.float32(-np.inf)
ZERO = np.float32(0.0)
_LO32 = np.uint64(0xFFFFFFFF)


def key_tile(head_dim: int) -> int:
    """KT: keys per tile. At Hd = 128, 32 keys keep the two stages of K and V at 32 KB of shared memory and the S
    fragments at 16 registers."""
    return 32 if head_dim == 128 else 64


def supports(kv_dtype, head_dim: int, block_size: int) -> bool:
    """Whether launch_attention_prefill_fastest runs the tensor-core kernel: bf16 pools, Hd 16, 32, 64 or 128,
    power-of-two blocks."""
    return (np.dtype(kv_dtype) == np.uint16 and head_dim in HEAD_DIMS and block_size > 0
            and block_size & (block_size - 1) == 0)


@cuda.jit(device=True, inline=True)
def _key_range(positions, r0, i, nq, window, k_hi):
    """[lo, hi) of the keys that row i of the tile attends to; empty for padding rows (i >= nq)."""
    if i >= nq:
        return np.int32(0), np.int32(0)
    p = positions[r0 + i]
    return np.int32(max(p - window + 1, 0) if window > 0 else 0), np.int32(min(p + 1, k_hi))


@cuda.jit(device=True, inline=True)
def _find_tile(seq_starts, num_seqs, info, counts, tid):
    """info[0:3] = (sequence, first row, rows) of this block's query tile, info[0] = -1 for a block past the last
    tile. Blocks walk the sequences' tile counts (loaded THREADS at a time, walked by thread 0), last tile first."""
    if tid == 0:
        info[0] = -1
        info[3] = 0                              # tiles before this chunk of sequences
    for c0 in range(0, num_seqs, THREADS):
        cuda.syncthreads()
        sq = c0 + tid
        counts[tid] = (seq_starts[sq + 1] - seq_starts[sq] + BQ - 1) // BQ if sq < num_seqs else 0
        cuda.syncthreads()
        if tid == 0 and info[0] < 0:
            first = info[3]
            for j in range(min(THREADS, num_seqs - c0)):
                tiles = counts[j]
                if cuda.blockIdx.x < first + tiles:
                    r0 = seq_starts[c0 + j] + (first + tiles - 1 - cuda.blockIdx.x) * BQ
                    info[0] = c0 + j
                    info[1] = r0
                    info[2] = min(BQ, seq_starts[c0 + j + 1] - r0)
                    break
                first += tiles
            info[3] = first
    cuda.syncthreads()


@functools.cache
def _build(head_dim: int):
    kt = key_tile(head_dim)
    lay = tile_layout(kt, head_dim, THREADS)
    row_u64, row_u32, tile_u64, tile_u32, copies, swz = (lay.row_u64, lay.row_u32, lay.tile_u64, lay.tile_u32,
                                                         lay.copies, lay.swz)
    nks = head_dim // 16                   # k-steps of Q K^T, and n-tile pairs of P V
    nsn, nkk = kt // 8, kt // 16           # n-tiles of S, k-steps of P V
    qa_len, acc_len, sc_len = 4 * nks, 8 * nks, 4 * nsn   # array sizes must be closure constants
    k_len, v_len = STAGES * tile_u64, STAGES * tile_u32
    prime, advance = tile_pipeline(kt, head_dim, THREADS, STAGES)
    pv = pv_product(head_dim, True)

    def attention_prefill_mma_kernel(q, k_words, v_words, seq_starts, positions, block_tables, context_lens,
                                     block_shift, num_kv_heads, window, qscale, out):
        """q: [T * H * Hd] float32, the flat [T, H, Hd] queries (sequence s owns rows seq_starts[s]:seq_starts[s+1],
        ascending positions [T]).
        k_words, v_words: [NB * BS * Hkv * Hd / 2] uint32 views of the bf16 pools [NB, BS, Hkv, Hd], already holding
        these tokens. block_tables: [S, max_blocks] int32; context_lens: [S] int32 (after this step).
        block_shift: log2(BS), num_kv_heads, window (0 = none): int32; qscale: scale * log2(e), float32.
        out: [T * H * Hd] float32, flat as q. Grid (ceil(T / BQ) + S, H), block (THREADS,)."""
        tid = cuda.threadIdx.x
        h = cuda.blockIdx.y
        num_heads = cuda.gridDim.y
        kvh = h // (num_heads // num_kv_heads)
        info = cuda.shared.array(4, types.int32)
        counts = cuda.shared.array(THREADS, types.int32)
        _find_tile(seq_starts, context_lens.shape[0], info, counts, tid)
        s = info[0]
        if s < 0:
            return
        r0 = info[1]
        nq = info[2]
        k_hi = min(context_lens[s], positions[r0 + nq - 1] + 1)
        k_lo = max(0, positions[r0] - window + 1) if window > 0 else 0
        n_tiles = (max(k_hi - k_lo, 0) + kt - 1) // kt

        lane = tid % 32
        g = lane // 4
        t = lane % 4
        wr = (tid // 32) * 16                    # this warp's first row in the tile
        lo0, hi0 = _key_range(positions, r0, wr + g, nq, window, k_hi)
        lo1, hi1 = _key_range(positions, r0, wr + g + 8, nq, window, k_hi)
        lo_first, hi_first = _key_range(positions, r0, wr, nq, window, k_hi)
        lo_last, hi_last = _key_range(positions, r0, min(wr + 15, nq - 1), nq, window, k_hi)
        full_warp = wr + 16 <= nq

        # the first element of rows g and g + 8 of this warp in q / out (head h), and this lane's 4 head dims' offset
        at0 = ((r0 + wr + g) * num_heads + h) * head_dim + 4 * t
        at1 = at0 + 8 * num_heads * head_dim
        qa = cuda.local.array(qa_len, types.uint32)    # A fragments of q (rows g, g + 8; head dims permuted)
        for kk in range(nks):
            for half in range(2):
                x0 = x1 = x2 = x3 = ZERO
                if wr + g + 8 * half < nq:
                    x0, x1, x2, x3 = ld_v4(q, (at0 if half == 0 else at1) + 16 * kk)
                qa[4 * kk + half] = pack(x0 * qscale, x1 * qscale)
                qa[4 * kk + 2 + half] = pack(x2 * qscale, x3 * qscale)
        acc = cuda.local.array(acc_len, types.float32)  # per n-tile pair c: even-d tile c0..c3, odd-d tile c0..c3
        for j in range(acc_len):
            acc[j] = ZERO
        sc = cuda.local.array(sc_len, types.float32)    # S, then P, of the tile: n-tile j's c0..c3 at 4j
        m0 = m1 = NEG_INF                               # running max (base 2) of rows g and g + 8
        l0 = l1 = ZERO                                  # this lane's share of their running sums

        ks = cuda.shared.array(k_len, types.uint64, alignment=STAGE_ALIGN)
        vs = cuda.shared.array(v_len, types.uint32, alignment=STAGE_ALIGN)
        offs = cuda.local.array(copies, types.int64)
        row_words = np.int64(num_kv_heads * row_u32)
        head_word = np.int64(kvh * row_u32)
        prime(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, n_tiles, block_shift, row_words, head_word, offs)
        k_swz = (2 * (g % 4)) & swz               # K rows 8j + g: key % 4 == g % 4
        for it in range(n_tiles):
            stage = advance(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, it, n_tiles, block_shift,
                            row_words, head_word, offs)
            k0 = k_lo + it * kt
            if SIMULATOR or (wr < nq and k0 < hi_last and k0 + kt > lo_first):
                for j in range(sc_len):
                    sc[j] = ZERO
                for j in range(nsn):
                    base = stage * tile_u64 + (8 * j + g) * row_u64 + t % 2
                    for kk in range(nks):
                        kw = ld_shared(ks, base + 2 * ((2 * kk + t // 2) ^ k_swz))
                        sc[4 * j], sc[4 * j + 1], sc[4 * j + 2], sc[4 * j + 3] = mma(
                            qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3],
                            np.uint32(kw & _LO32), np.uint32(kw >> np.uint64(32)),
                            sc[4 * j], sc[4 * j + 1], sc[4 * j + 2], sc[4 * j + 3])
                if not (full_warp and k0 >= lo_last and k0 + kt <= hi_first):
                    for j in range(nsn):
                        for e in range(2):
                            key = np.int32(k0 + 8 * j + 2 * t + e)   # 32-bit compares against the int32 bounds
                            if key < lo0 or key >= hi0:
                                sc[4 * j + e] = NEG_INF
                            if key < lo1 or key >= hi1:
                                sc[4 * j + 2 + e] = NEG_INF
                mx0 = mx1 = NEG_INF
                for j in range(nsn):
                    mx0 = max(mx0, max(sc[4 * j], sc[4 * j + 1]))
                    mx1 = max(mx1, max(sc[4 * j + 2], sc[4 * j + 3]))
                mx0 = max(m0, quad_max(mx0))
                mx1 = max(m1, quad_max(mx1))
                base0 = mx0 if mx0 > NEG_INF else ZERO   # no allowed key yet: every p is 0
                base1 = mx1 if mx1 > NEG_INF else ZERO
                alpha0 = exp2(m0 - base0)
                alpha1 = exp2(m1 - base1)
                m0 = mx0
                m1 = mx1
                l0 *= alpha0
                l1 *= alpha1
                for j in range(nsn):
                    for e in range(2):
                        sc[4 * j + e] = exp2(sc[4 * j + e] - base0)
                        sc[4 * j + 2 + e] = exp2(sc[4 * j + 2 + e] - base1)
                        l0 += sc[4 * j + e]
                        l1 += sc[4 * j + 2 + e]
                for j in range(2 * nks):
                    acc[4 * j] *= alpha0
                    acc[4 * j + 1] *= alpha0
                    acc[4 * j + 2] *= alpha1
                    acc[4 * j + 3] *= alpha1
                for kk in range(nkk):
                    pa0 = pack(sc[8 * kk], sc[8 * kk + 1])       # row g, keys 16kk + 2t, +1
                    pa1 = pack(sc[8 * kk + 2], sc[8 * kk + 3])   # row g + 8
                    pa2 = pack(sc[8 * kk + 4], sc[8 * kk + 5])   # row g, keys 16kk + 8 + 2t, +1
                    pa3 = pack(sc[8 * kk + 6], sc[8 * kk + 7])
                    pv(vs, stage * tile_u32 + (16 * kk + 2 * t) * row_u32, pa0, pa1, pa2, pa3, acc)
            cuda.syncthreads()                    # the stage is read by every warp before it is refilled
        l0 = quad_sum(l0)
        l1 = quad_sum(l1)
        inv0 = np.float32(1.0) / l0 if l0 > 0 else ZERO
        inv1 = np.float32(1.0) / l1 if l1 > 0 else ZERO
        for half in range(2):
            inv = inv0 if half == 0 else inv1
            if wr + g + 8 * half < nq:
                for c in range(nks):
                    st_v4(out, (at0 if half == 0 else at1) + 16 * c, acc[8 * c + 2 * half] * inv,
                          acc[8 * c + 4 + 2 * half] * inv, acc[8 * c + 1 + 2 * half] * inv,
                          acc[8 * c + 5 + 2 * half] * inv)

    return attention_prefill_mma_kernel, cached_jit(attention_prefill_mma_kernel)


def launch_attention_prefill_mma(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, window: int,
                                 scale: float, out, stream=0) -> None:
    """attention_prefill's arguments (q: [T, H, Hd] float32; k_pool, v_pool: [NB, BS, Hkv, Hd] uint16 bf16 bits,
    `supports` holding; ...; out: [T, H, Hd] float32), on tensor cores."""
    num_tokens, num_heads, head_dim, num_seqs, num_kv_heads, block_size = check_arguments(
        "attention_prefill_mma", q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, out)
    if not supports(k_pool.dtype, head_dim, block_size):
        raise ValueError(f"attention_prefill_mma: no kernel for {np.dtype(k_pool.dtype).name} pools, head size "
                         f"{head_dim}, blocks of {block_size}")
    if not aligned_to(16, q, out, k_pool, v_pool):
        raise ValueError("attention_prefill_mma: q, out and the pools must start on 16 bytes (16-byte loads, stores "
                         "and copies)")
    if num_tokens == 0:
        return
    _build(head_dim)[1][(-(-num_tokens // BQ) + num_seqs, num_heads), THREADS, stream](
        q.reshape(-1), k_pool.reshape(-1).view(np.uint32), v_pool.reshape(-1).view(np.uint32), seq_starts, positions,
        block_tables, context_lens, np.int32(block_size.bit_length() - 1), np.int32(num_kv_heads), np.int32(window),
        np.float32(scale * LOG2E), out.reshape(-1))


def launch_attention_prefill_fastest(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, window: int,
                                     scale: float, out, stream=0) -> None:
    """attention_prefill, on tensor cores when `supports(k_pool.dtype, head_dim, block_size)` and the arrays start on
    16 bytes, else the fp32 kernel."""
    fast = supports(k_pool.dtype, q.shape[2], k_pool.shape[1]) and aligned_to(16, q, out, k_pool, v_pool)
    launch = launch_attention_prefill_mma if fast else launch_attention_prefill
    launch(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, window, scale, out, stream)


def sm90_signatures():
    """(python function, numba signature) at Hd = 64 and 128."""
    f32, u32, i32 = types.float32[::1], types.uint32[::1], types.int32
    sig = (f32, u32, u32, i32[::1], i32[::1], i32[:, ::1], i32[::1], i32, i32, i32, types.float32, f32)
    return [(_build(hd)[0], sig) for hd in (64, 128)]
