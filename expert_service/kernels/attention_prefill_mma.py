"""attention_prefill on tensor cores for bf16 KV pools: the same operation and launcher signature as
kernels.attention_prefill (varlen causal attention of a step's new tokens over each sequence's paged KV cache,
chunked prefill, sliding window, GQA), with QK^T and PV on inline-PTX mma.sync m16n8k16 bf16 (kernels.mma).
`launch_attention_prefill_fastest` picks this kernel when it applies and the fp32 CUDA-core kernel otherwise (fp32/fp16
pools, head sizes that are not a multiple of 16, the CUDA simulator, which cannot run inline PTX).

Design (FlashAttention-2, one warp per 16 query rows):
- Block = (query tile of BQ = 64 rows of one sequence, query head), 4 warps. Grid x is ceil(T / BQ) + S as in
  launch_attention_prefill; the block -> (sequence, tile) walk reads the tile counts in parallel, and a sequence's
  last (most keys) tile is launched first.
- q is scaled by scale * log2(e), rounded to bf16 and kept in registers as A fragments, so softmax runs in base
  2 (ex2.approx). S = Q K^T and O += P V accumulate in fp32 registers; P is rounded to bf16 for the PV product
  (its C fragment is P's A fragment), the row sums use the fp32 p, and quad shuffles give the row maxima.
- Per key tile of BK keys (64 at Hd <= 64, 32 at Hd = 128), K is staged as bf16 rows and V transposed
  (V^T[d, key]), both as uint64 words of 4 values read 8 bytes at a time from the pool, each thread's words
  loaded into registers before any is stored; the next tile's block-table reads overlap them.
- The k index of each mma is permuted so that one 8-byte shared load yields a lane's whole B fragment: head
  dims 16c + 4t .. +3 for QK^T (q uses the same order), keys 16c + 4t .. +3 for PV, which fixes the order of K
  rows in shared memory (see `_k_row`). Row strides are 8 mod 16 words, so the fragment loads and the
  transposing stores are free of bank conflicts.
- Scores are masked only in tiles that cross a row's causal / window bound; a warp skips tiles outside all
  its rows' ranges (its block still stages them).
Registers: 255 at Hd = 128 (q, S and O fragments), with ~72 B spilled; 2 blocks per SM.
Numerics: bf16 q and P give ~3e-3 relative error on outputs (vs the fp32 kernel's 1e-5 at fp32 storage).
Not done: GQA packing (K/V are read once per query head, from L2), cp.async double buffering, Hd = 256.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.attention_prefill import check_arguments, launch_attention_prefill
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.mma import exp2_approx
from expert_service.kernels.mma import mma_bf16_m16n8k16 as mma
from expert_service.kernels.mma import pack_bf16x2 as pack
from expert_service.kernels.numeric import SIMULATOR, quad_max, quad_sum

WARPS = 4
THREADS = 32 * WARPS
BQ = 16 * WARPS                  # query rows per block, 16 per warp (the mma M)
MAX_HEAD_DIM = 128               # Hd = 256 spills ~1 KB of registers: q would have to move to shared memory
LOG2E = 1.4426950408889634
NEG_INF = np.float32(-np.inf)
_LO32 = np.uint64(0xFFFFFFFF)
_U16 = np.uint64(0xFFFF)


def key_tile(head_dim: int) -> int:
    """BK: keys per tile. At Hd = 128 a 64-key tile made ptxas spill (255 registers: S, O and q fragments)."""
    return 64 if head_dim <= 64 else 32


def supports(kv_dtype, head_dim: int) -> bool:
    """Whether launch_attention_prefill_fastest runs the tensor-core kernel for this pool dtype and head size."""
    return (not SIMULATOR and np.dtype(kv_dtype) == np.uint16 and head_dim % 16 == 0
            and 16 <= head_dim <= MAX_HEAD_DIM)


def _stride_words(n: int) -> int:
    """Smallest row stride >= n 32-bit words that is 8 mod 16: lanes g = 0..3 of a fragment load (and the 4 rows
    of a transposing store) then start 8 or 24 banks apart."""
    return n + (8 - n) % 16


@cuda.jit(device=True, inline=True)
def _k_row(o):
    """Shared-memory row of key o of a tile: key 16c + 4a + 2e + b goes to row 16c + 8e + 2a + b, which lane
    g = 2a + b reads as column g of S's n-tile 2c + e; that puts keys 16c + 4t .. +3 on lane t's P fragment."""
    return (o & ~15) | ((o & 2) << 2) | ((o >> 1) & 6) | (o & 1)


@cuda.jit(device=True, inline=True)
def _key_range(positions, r0, i, nq, window, k_hi):
    """[lo, hi) of the keys that row i of the tile attends to; empty for padding rows (i >= nq)."""
    if i >= nq:
        return np.int32(0), np.int32(0)
    p = positions[r0 + i]
    return np.int32(max(p - window + 1, 0) if window > 0 else 0), np.int32(min(p + 1, k_hi))


@cuda.jit(device=True, inline=True)
def _key_base(block_tables, s, kpos, k_hi, block_size, row_words, head_word):
    """Pool word (uint64 units) where the row of key kpos of sequence s starts; -1 for kpos >= k_hi."""
    if kpos >= k_hi:
        return np.int64(-1)
    blk = block_tables[s, kpos // block_size]
    return (np.int64(blk) * block_size + kpos % block_size) * row_words + head_word


@functools.cache
def _build(head_dim: int):
    bk = key_tile(head_dim)
    hw = head_dim // 4                         # uint64 words per K/V row
    k_stride = _stride_words(head_dim // 2) // 2   # in uint64 words
    v_stride = _stride_words(bk // 2) // 2
    nks, nsn, nkk, non = head_dim // 16, bk // 8, bk // 16, head_dim // 8   # k-steps / n-tiles of S, then O
    dq_groups = hw // 4
    qa_len, acc_len, sc_len, pa_len = 4 * nks, 4 * non, 4 * nsn, 4 * nkk   # local array sizes must be constants
    k_iters = -(-bk * hw // THREADS)           # K words per thread per tile
    v_iters = -(-bk * hw // (4 * THREADS))     # V units (4 keys x 4 dims) per thread per tile
    v_regs = 4 * v_iters

    def attention_prefill_mma_kernel(q, k64, v64, seq_starts, positions, block_tables, context_lens, block_size,
                                     num_kv_heads, window, qscale, out):
        """q: [T, H, Hd] float32 (sequence s owns rows seq_starts[s]:seq_starts[s+1], ascending positions [T]).
        k64, v64: [NB * BS * Hkv * Hd / 4] uint64 views of the bf16 pools [NB, BS, Hkv, Hd], already holding
        these tokens. block_tables: [S, max_blocks] int32; context_lens: [S] int32 (after this step).
        block_size, num_kv_heads, window (0 = none): int32; qscale: scale * log2(e), float32.
        out: [T, H, Hd] float32. Grid (ceil(T / BQ) + S, H), block (THREADS,)."""
        tid = cuda.threadIdx.x
        h = cuda.blockIdx.y
        kvh = h // (q.shape[1] // num_kv_heads)
        info = cuda.shared.array(4, types.int32)     # sequence, first row, rows; tiles before this chunk
        counts = cuda.shared.array(THREADS, types.int32)
        if tid == 0:
            info[0] = -1
            info[3] = 0
        num_seqs = context_lens.shape[0]
        for c0 in range(0, num_seqs, THREADS):   # tile counts loaded in parallel, then walked by thread 0
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
        s = info[0]
        if s < 0:
            return
        r0 = info[1]
        nq = info[2]
        k_hi = min(context_lens[s], positions[r0 + nq - 1] + 1)
        k_lo = max(0, positions[r0] - window + 1) if window > 0 else 0

        lane = tid % 32
        g = lane // 4
        t = lane % 4
        wr = (tid // 32) * 16                    # this warp's first row in the tile
        lo0, hi0 = _key_range(positions, r0, wr + g, nq, window, k_hi)
        lo1, hi1 = _key_range(positions, r0, wr + g + 8, nq, window, k_hi)
        lo_first, hi_first = _key_range(positions, r0, wr, nq, window, k_hi)
        lo_last, hi_last = _key_range(positions, r0, min(wr + 15, nq - 1), nq, window, k_hi)
        full_warp = wr + 16 <= nq

        qa = cuda.local.array(qa_len, types.uint32)    # A fragments of q, head dims permuted (module doc)
        for ks in range(nks):
            for half in range(2):
                i = wr + g + 8 * half
                x0 = x1 = x2 = x3 = np.float32(0.0)
                if i < nq:
                    d = 16 * ks + 4 * t
                    x0 = q[r0 + i, h, d] * qscale
                    x1 = q[r0 + i, h, d + 1] * qscale
                    x2 = q[r0 + i, h, d + 2] * qscale
                    x3 = q[r0 + i, h, d + 3] * qscale
                qa[4 * ks + half] = pack(x0, x1)
                qa[4 * ks + 2 + half] = pack(x2, x3)
        acc = cuda.local.array(acc_len, types.float32)  # O fragments, rows g and g + 8
        sc = cuda.local.array(sc_len, types.float32)   # S fragments, then p
        pa = cuda.local.array(pa_len, types.uint32)    # P as A fragments
        for j in range(4 * non):
            acc[j] = np.float32(0.0)
        m0 = m1 = NEG_INF                       # running max (base 2) of rows g and g + 8
        l0 = l1 = np.float32(0.0)               # this lane's share of their running sums

        k_s = cuda.shared.array((bk, k_stride), types.uint64)
        vt_s = cuda.shared.array((head_dim, v_stride), types.uint64)
        kbase = cuda.shared.array((2, bk), types.int64)   # pool word of each key's row, -1 past the range
        kreg = cuda.local.array(k_iters, types.uint64)
        vreg = cuda.local.array(v_regs, types.uint64)
        row_words = num_kv_heads * hw
        if tid < bk:
            kbase[0, tid] = _key_base(block_tables, s, k_lo + tid, k_hi, block_size, row_words, kvh * hw)
        for it in range((k_hi - k_lo + bk - 1) // bk):
            k0 = k_lo + it * bk
            cur = it % 2
            cuda.syncthreads()                   # kbase[cur] written; every warp is done with the previous tile
            # Each thread's K words (then V words) are loaded into registers before any is stored: a loop that
            # loads and stores in turn waits out one L2 latency per element. (K and V together spill at Hd=128.)
            nxt = np.int64(-1)
            if tid < bk:
                nxt = _key_base(block_tables, s, k0 + bk + tid, k_hi, block_size, row_words, kvh * hw)
            for i in range(k_iters):
                u = tid + i * THREADS
                kreg[i] = np.uint64(0)
                if u < bk * hw:
                    b = kbase[cur, u // hw]
                    if b >= 0:
                        kreg[i] = k64[b + u % hw]
            for i in range(k_iters):
                u = tid + i * THREADS
                if u < bk * hw:
                    k_s[_k_row(u // hw), u % hw] = kreg[i]
            for i in range(v_iters):
                # 4 lanes along the head dim (one 32-byte sector per key row) x 8 key quads per warp.
                u = tid + i * THREADS
                grp = u // 32
                dq = (u % 4) + 4 * (grp % dq_groups)
                kq = (u % 32) // 4 + 8 * (grp // dq_groups)
                for r in range(4):
                    vreg[4 * i + r] = np.uint64(0)   # zeros past the range: 0 * garbage could be NaN
                    if u < bk * hw // 4:
                        b = kbase[cur, 4 * kq + r]
                        if b >= 0:
                            vreg[4 * i + r] = v64[b + dq]
            for i in range(v_iters):
                u = tid + i * THREADS
                grp = u // 32
                dq = (u % 4) + 4 * (grp % dq_groups)
                kq = (u % 32) // 4 + 8 * (grp // dq_groups)
                if u < bk * hw // 4:
                    for j in range(4):
                        r = (j + dq) & 3         # rotate rows so the 4 lanes along d hit different banks
                        sh = np.uint64(16 * r)
                        vt_s[4 * dq + r, kq] = (((vreg[4 * i] >> sh) & _U16)
                                                | (((vreg[4 * i + 1] >> sh) & _U16) << np.uint64(16))
                                                | (((vreg[4 * i + 2] >> sh) & _U16) << np.uint64(32))
                                                | (((vreg[4 * i + 3] >> sh) & _U16) << np.uint64(48)))
            if tid < bk:
                kbase[1 - cur, tid] = nxt
            cuda.syncthreads()
            if wr < nq and k0 < hi_last and k0 + bk > lo_first:
                for j in range(4 * nsn):
                    sc[j] = np.float32(0.0)
                for ks in range(nks):
                    for j in range(nsn):
                        kw = k_s[8 * j + g, 4 * ks + t]
                        sc[4 * j], sc[4 * j + 1], sc[4 * j + 2], sc[4 * j + 3] = mma(
                            qa[4 * ks], qa[4 * ks + 1], qa[4 * ks + 2], qa[4 * ks + 3],
                            np.uint32(kw & _LO32), np.uint32(kw >> np.uint64(32)),
                            sc[4 * j], sc[4 * j + 1], sc[4 * j + 2], sc[4 * j + 3])
                if not (full_warp and k0 >= lo_last and k0 + bk <= hi_first):
                    for j in range(nsn):
                        for e in range(2):
                            key = k0 + 16 * (j // 2) + 4 * t + 2 * (j % 2) + e
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
                base0 = mx0 if mx0 > NEG_INF else np.float32(0.0)   # no allowed key yet: every p is 0
                base1 = mx1 if mx1 > NEG_INF else np.float32(0.0)
                alpha0 = exp2_approx(m0 - base0)
                alpha1 = exp2_approx(m1 - base1)
                m0 = mx0
                m1 = mx1
                l0 *= alpha0
                l1 *= alpha1
                for j in range(nsn):
                    for e in range(2):
                        sc[4 * j + e] = exp2_approx(sc[4 * j + e] - base0)
                        sc[4 * j + 2 + e] = exp2_approx(sc[4 * j + 2 + e] - base1)
                        l0 += sc[4 * j + e]
                        l1 += sc[4 * j + 2 + e]
                for j in range(non):
                    acc[4 * j] *= alpha0
                    acc[4 * j + 1] *= alpha0
                    acc[4 * j + 2] *= alpha1
                    acc[4 * j + 3] *= alpha1
                for kk in range(nkk):
                    for r in range(4):               # n-tile 2kk + r // 2, rows g (r even) / g + 8 (r odd)
                        c = 8 * kk + 4 * (r // 2) + 2 * (r % 2)
                        pa[4 * kk + r] = pack(sc[c], sc[c + 1])
                for kk in range(nkk):
                    for j in range(non):
                        vw = vt_s[8 * j + g, 4 * kk + t]
                        acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3] = mma(
                            pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3],
                            np.uint32(vw & _LO32), np.uint32(vw >> np.uint64(32)),
                            acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])
            cuda.syncthreads()                       # K/V tile read by every warp before the next staging
        l0 = quad_sum(l0)
        l1 = quad_sum(l1)
        inv0 = np.float32(1.0) / l0 if l0 > 0 else np.float32(0.0)
        inv1 = np.float32(1.0) / l1 if l1 > 0 else np.float32(0.0)
        i0 = wr + g
        for j in range(non):
            d = 8 * j + 2 * t
            if i0 < nq:
                out[r0 + i0, h, d] = acc[4 * j] * inv0
                out[r0 + i0, h, d + 1] = acc[4 * j + 1] * inv0
            if i0 + 8 < nq:
                out[r0 + i0 + 8, h, d] = acc[4 * j + 2] * inv1
                out[r0 + i0 + 8, h, d + 1] = acc[4 * j + 3] * inv1

    return attention_prefill_mma_kernel, cached_jit(attention_prefill_mma_kernel)


def launch_attention_prefill_mma(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, window: int,
                          scale: float, out, stream=0) -> None:
    """attention_prefill's arguments (q: [T, H, Hd] float32; k_pool, v_pool: [NB, BS, Hkv, Hd] uint16 bf16 bits
    with Hd a multiple of 16, <= MAX_HEAD_DIM; ...; out: [T, H, Hd] float32), on tensor cores."""
    num_tokens, num_heads, head_dim, num_seqs, num_kv_heads, block_size = check_arguments(
        "attention_prefill_mma", q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, out)
    assert k_pool.dtype == np.uint16, k_pool.dtype
    assert head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM, head_dim
    if num_tokens == 0:
        return
    kernel = _build(head_dim)[1]
    kernel[(-(-num_tokens // BQ) + num_seqs, num_heads), THREADS, stream](
        q, k_pool.reshape(-1).view(np.uint64), v_pool.reshape(-1).view(np.uint64), seq_starts, positions,
        block_tables, context_lens, np.int32(block_size), np.int32(num_kv_heads), np.int32(window),
        np.float32(scale * LOG2E), out)


def launch_attention_prefill_fastest(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, window: int,
                           scale: float, out, stream=0) -> None:
    """attention_prefill, on tensor cores when `supports(k_pool.dtype, head_dim)`, else the fp32 kernel."""
    launch = launch_attention_prefill_mma if supports(k_pool.dtype, q.shape[2]) else launch_attention_prefill
    launch(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, window, scale, out, stream)


def sm90_signatures():
    """(python function, numba signature) at Hd = 64 and 128."""
    f32_3d, u64, i32 = types.float32[:, :, ::1], types.uint64[::1], types.int32
    return [(_build(hd)[0], (f32_3d, u64, u64, i32[::1], i32[::1], i32[:, ::1], i32[::1], i32, i32, i32,
                             types.float32, f32_3d))
            for hd in (64, 128)]
