"""Varlen causal attention of a step's new tokens over each sequence's paged KV cache, flash-attention
style (numpy reference: expert_service.cpu.layers.attention.paged_attention). The new tokens' keys and values
are already in the pool (launch_kv_write runs first), so chunked prefill needs nothing special: a chunk's queries
read the earlier chunks from the same block table.

Design:
- Block = (query tile of BQ consecutive rows of one sequence, query head). Grid x is ceil(T/BQ) + S, an
  upper bound on the number of tiles that depends only on T and S (graph-friendly); thread 0 maps the block
  index to (sequence, tile) by walking seq_starts, and spare blocks exit.
- Per key tile of BK keys (only the range the tile's causal / sliding-window masks allow): K and V are
  gathered through the block table into shared memory as float32 (K rows padded by one word so threads
  reading different keys hit different banks), scores go to shared memory, one thread per query row keeps
  its online-softmax max and sum, and each thread rescales and accumulates its share of the [BQ, Hd] output
  in registers. Everything is float32 on CUDA cores.
- Tile sizes come from the head size (TILE_CANDIDATES, the first that fits SMEM_BUDGET bytes of static
  shared memory): Hd=128 -> 32x16, Hd<=96 -> 32x32, Hd=256 -> 16x8.
Limitations: K/V are read once per query head (the GQA group re-reads them from L2), and no tensor cores;
an inline-PTX mma version is the next step if prefill attention shows up in profiles.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import loader

THREADS = 128
SMEM_BUDGET = 44 * 1024                   # static shared memory is capped at 48 KB
TILE_CANDIDATES = ((32, 32), (32, 16), (32, 8), (16, 16), (16, 8))   # (BQ, BK), BQ * BK >= THREADS
NEG_INF = np.float32(-np.inf)


def tile_sizes(head_dim: int) -> tuple[int, int]:
    """(BQ, BK) for a head size: q, K (padded), V, score tiles and row state must fit SMEM_BUDGET."""
    for bq, bk in TILE_CANDIDATES:
        if 4 * (bq * head_dim + bk * (head_dim + 1) + bk * head_dim + bq * (bk + 1) + 3 * bq) <= SMEM_BUDGET:
            return bq, bk
    raise ValueError(f"head_dim {head_dim} too large for attention_prefill")


@functools.cache
def _build(kv_dtype, head_dim: int):
    load = loader(kv_dtype)
    bq, bk = tile_sizes(head_dim)
    kstride = head_dim + 1            # padded K row
    pstride = bk + 1                  # padded score row
    q_len, k_len, v_len, p_len = bq * head_dim, bk * kstride, bk * head_dim, bq * pstride
    score_rows = bq * bk // THREADS   # scores per thread: one key column, rows strided by THREADS // bk
    row_step = THREADS // bk
    out_per_thread = -(-bq * head_dim // THREADS)

    def attention_prefill_kernel(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, block_size,
                                 num_kv_heads, window, scale, out):
        """q: [T, H, Hd] float32, the step's new tokens; sequence s owns rows seq_starts[s]:seq_starts[s+1]
        (seq_starts: [S + 1] int32) with ascending positions ([T] int32, position in its sequence).
        k_pool, v_pool: [NB * BS * Hkv * Hd] flat views of the layer's pools [NB, BS, Hkv, Hd] (kv dtype),
        already holding these tokens. block_tables: [S, max_blocks] int32; context_lens: [S] int32 (cache
        length after this step). A query attends to keys at positions <= its own, and > its own - window
        when window > 0. block_size, num_kv_heads, window: int32; scale: float32.
        out: [T, H, Hd] float32. Grid (ceil(T / BQ) + S, H), block (THREADS,)."""
        tid = cuda.threadIdx.x
        h = cuda.blockIdx.y
        kvh = h // (q.shape[1] // num_kv_heads)
        info = cuda.shared.array(5, types.int32)     # sequence, first row, rows, min and max query position
        if tid == 0:
            info[0] = -1
            first = 0
            for s in range(context_lens.shape[0]):
                tiles = (seq_starts[s + 1] - seq_starts[s] + bq - 1) // bq
                if cuda.blockIdx.x < first + tiles:
                    r0 = seq_starts[s] + (cuda.blockIdx.x - first) * bq
                    info[0] = s
                    info[1] = r0
                    info[2] = min(bq, seq_starts[s + 1] - r0)
                    info[3] = positions[r0]
                    info[4] = positions[r0 + info[2] - 1]
                    break
                first += tiles
        cuda.syncthreads()
        s = info[0]
        if s < 0:
            return
        r0 = info[1]
        nq = info[2]
        k_hi = min(context_lens[s], info[4] + 1)
        k_lo = max(0, info[3] - window + 1) if window > 0 else 0

        q_s = cuda.shared.array(q_len, types.float32)
        k_s = cuda.shared.array(k_len, types.float32)
        v_s = cuda.shared.array(v_len, types.float32)
        p_s = cuda.shared.array(p_len, types.float32)
        qpos_s = cuda.shared.array(bq, types.int32)
        alpha_s = cuda.shared.array(bq, types.float32)
        den_s = cuda.shared.array(bq, types.float32)
        for e in range(tid, q_len, THREADS):
            i = e // head_dim
            q_s[e] = q[r0 + i, h, e % head_dim] * scale if i < nq else np.float32(0.0)
        if tid < bq:
            qpos_s[tid] = positions[r0 + tid] if tid < nq else -1

        acc = cuda.local.array(out_per_thread, types.float32)
        sc = cuda.local.array(score_rows, types.float32)
        for r in range(out_per_thread):
            acc[r] = 0.0
        m = NEG_INF                  # online-softmax state of row `tid` (threads tid < bq)
        den = np.float32(0.0)
        row = num_kv_heads * head_dim
        j = tid % bk                 # this thread's key column in the score tile
        for k0 in range(k_lo, k_hi, bk):
            cuda.syncthreads()       # the previous tile's K/V/P are no longer read
            for e in range(tid, v_len, THREADS):
                jj = e // head_dim
                d = e % head_dim
                kpos = k0 + jj
                kval = np.float32(0.0)
                vval = np.float32(0.0)
                if kpos < k_hi:
                    blk = block_tables[s, kpos // block_size]
                    off = (np.int64(blk) * block_size + kpos % block_size) * row + kvh * head_dim + d
                    kval = load(k_pool, off)
                    vval = load(v_pool, off)
                k_s[jj * kstride + d] = kval
                v_s[e] = vval
            cuda.syncthreads()
            for r in range(score_rows):
                sc[r] = 0.0
            for d in range(head_dim):
                kd = k_s[j * kstride + d]
                for r in range(score_rows):
                    sc[r] += q_s[(tid // bk + r * row_step) * head_dim + d] * kd
            kpos = k0 + j
            for r in range(score_rows):
                i = tid // bk + r * row_step
                qp = qpos_s[i]
                ok = kpos < k_hi and kpos <= qp and (window <= 0 or kpos > qp - window)
                p_s[i * pstride + j] = sc[r] if ok else NEG_INF
            cuda.syncthreads()
            if tid < bq:
                m_new = m
                for jj in range(bk):
                    m_new = max(m_new, p_s[tid * pstride + jj])
                alpha = np.float32(1.0)
                total = np.float32(0.0)
                if m_new > NEG_INF:      # else the row saw no allowed key yet: all p = 0, state unchanged
                    alpha = math.exp(m - m_new)
                    for jj in range(bk):
                        p = math.exp(p_s[tid * pstride + jj] - m_new)
                        p_s[tid * pstride + jj] = p
                        total += p
                else:
                    for jj in range(bk):
                        p_s[tid * pstride + jj] = 0.0
                den = den * alpha + total
                m = m_new
                alpha_s[tid] = alpha
            cuda.syncthreads()
            # The constant-trip r loops innermost, so they unroll and acc stays in registers.
            for r in range(out_per_thread):
                e = tid + r * THREADS
                if e < q_len:
                    acc[r] *= alpha_s[e // head_dim]
            for jj in range(bk):
                for r in range(out_per_thread):
                    e = tid + r * THREADS
                    if e < q_len:
                        acc[r] += p_s[(e // head_dim) * pstride + jj] * v_s[jj * head_dim + e % head_dim]
        if tid < bq:
            den_s[tid] = den
        cuda.syncthreads()
        for r in range(out_per_thread):
            e = tid + r * THREADS
            i = e // head_dim
            if e < q_len and i < nq:
                total = den_s[i]
                out[r0 + i, h, e % head_dim] = acc[r] / total if total > 0 else np.float32(0.0)

    return attention_prefill_kernel, cached_jit(attention_prefill_kernel)


def check_arguments(kernel: str, q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, out):
    """Shapes, dtypes and contiguity of a prefill attention launch (this kernel's and the tensor-core one's);
    returns (T, H, Hd, S, Hkv, block_size)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    num_kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    assert q.dtype == out.dtype == np.float32 and out.shape == q.shape, (q.dtype, out.dtype, out.shape)
    assert k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype and k_pool.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert seq_starts.shape == (num_seqs + 1,) and positions.shape == (num_tokens,)
    assert block_tables.shape[0] == num_seqs
    assert seq_starts.dtype == positions.dtype == block_tables.dtype == context_lens.dtype == np.int32
    for a in (q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, out):
        assert a.flags["C_CONTIGUOUS"], f"{kernel} needs contiguous arrays"
    return num_tokens, num_heads, head_dim, num_seqs, num_kv_heads, block_size


def launch_attention_prefill(q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, window: int,
                      scale: float, out, stream=0) -> None:
    """q: [T, H, Hd] float32; k_pool, v_pool: [NB, BS, Hkv, Hd] (float32, float16 or uint16 = bf16 bits),
    already holding this step's keys/values; seq_starts: [S + 1] int32; positions: [T] int32 (ascending
    within a sequence); block_tables: [S, max_blocks] int32; context_lens: [S] int32; window: 0 = none;
    out: [T, H, Hd] float32."""
    num_tokens, num_heads, head_dim, num_seqs, num_kv_heads, block_size = check_arguments(
        "attention_prefill", q, k_pool, v_pool, seq_starts, positions, block_tables, context_lens, out)
    if num_tokens == 0:
        return
    bq = tile_sizes(head_dim)[0]
    kernel = _build(np.dtype(k_pool.dtype), head_dim)[1]
    kernel[(-(-num_tokens // bq) + num_seqs, num_heads), THREADS, stream](
        q, k_pool.reshape(-1), v_pool.reshape(-1), seq_starts, positions, block_tables, context_lens,
        np.int32(block_size), np.int32(num_kv_heads), np.int32(window), np.float32(scale), out)


def sm90_signatures():
    """(python function, numba signature) of each kv dtype at Hd=128 and 64, plus odd head sizes 20 and 24."""
    f32_3d, i32 = types.float32[:, :, ::1], types.int32
    variants = [(np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)]
    cases = [(v, hd) for v in variants for hd in (64, 128)] + [(variants[2], 20), (variants[0], 24)]
    return [(_build(np.dtype(dtype), hd)[0],
             (f32_3d, nb[::1], nb[::1], i32[::1], i32[::1], i32[:, ::1], i32[::1], i32, i32, i32, types.float32,
              f32_3d))
            for (dtype, nb), hd in cases]
