"""Paged decode attention on tensor cores for bf16 KV pools: the operation and arguments of
kernels.attention_decode (one query per sequence over its cached keys, GQA, sliding window, split-K partials in
part_out / part_ml) with Q K^T and P V on `mma.sync m16n8k16` bf16 (kernels.mma). The query heads that share a kv
head are the 16 rows of the products' A operand, so every K/V byte of a (sequence, kv head) is read once and
multiplied for all of its heads at tensor-core rate; the CUDA-core kernels spend ~3 instructions a byte there.

Design (block = (sequence, kv head, split), WARPS warps, one 16-key slice of each tile per warp):
- Tiles of KT keys go global -> shared by 16-byte `cp.async` through STAGES stages (kernels.kv_tiles): the next
  STAGES - 1 tiles are in flight while tile n is computed, and the block-table reads of the tile after them are
  issued then too. Rows stay bf16 in their pool layout. The warps' final merge reuses the stages' memory.
- S = Q K^T: A = q (rows = the group's heads, scaled by scale * log2(e) and rounded to bf16, held in registers),
  B = K rows read as 8-byte words: the k index is permuted so that lane t's pairs are head dims 16c + 4t .. +3 (q
  takes the same order), so one load yields a lane's whole B fragment.
- Online softmax in base 2 per head row, on the S fragments (quad shuffles for the row maxima); P is rounded to
  bf16 and, as the C fragments of S, is already P V's A operand.
- P V (kernels.kv_tiles.pv_product): B = V[key][d] needs two keys per register; a lane loads the 32-bit words
  (d = 2m, 2m + 1) of keys 2t and 2t + 1 (and 2t + 8, 2t + 9) and `prmt` pairs their low halves into the B fragment
  of column d = 2m and their high halves into that of d = 2m + 1 (the n index is permuted: n-tiles of even and of
  odd head dims). A lane then ends with head dims 16c + 4t .. +3 of its rows.
- Shared rows are XOR-swizzled per 16-byte chunk (K by key % 4, V by (key / 2) % 4, on chunk bits 1-2), which
  makes both the 8-byte K fragment loads and the 32-bit V loads free of bank conflicts.
- Split-K: each sequence's keys are cut into parts of at least `min_keys` (a multiple of KT), at most the
  grid's P parts, so short contexts take few blocks and no merge: with one part the split-0 block writes `out`
  and the reduce kernel returns at once; otherwise parts write unnormalised partials with (max in base 2, sum)
  and `attention_decode_mma_reduce` merges the parts that exist. Both kernels derive the part count from the
  sequence's context on the device, so one captured graph serves every context length.
Numerics: bf16 q and P give ~3e-3 relative error on the outputs (attention_decode: 1e-5 at fp32 accumulation),
the same as attention_prefill_mma.
Under the CUDA simulator the mma, the pack and exp2 are `block_mma` / `block_pack` / `block_exp2` (an exact
emulation), so CI runs this kernel on small shapes.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from expert_service.kernels.attention_decode import check_arguments, part_merger
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.kv_tiles import STAGE_ALIGN, pv_product, tile_layout, tile_pipeline
from expert_service.kernels.mma import block_exp2 as exp2
from expert_service.kernels.mma import block_mma as mma
from expert_service.kernels.mma import block_pack as pack
from expert_service.kernels.numeric import f32_as_u32, quad_max, quad_sum, u32_as_f32
from expert_service.kernels.ptx import ld_shared

WARPS = 2
THREADS = 32 * WARPS
KT = 16 * WARPS               # keys per tile: 16 per warp, one k-step of P V
MAX_GROUP = 16                # query heads per kv head: the mma's 16 A rows
HEAD_DIMS = (16, 32, 64, 128)  # powers of two of 16-byte chunks a row (the staging and the swizzles need them)
STAGES = 2                    # tiles in shared memory: one in flight while one is computed (3 at most: at
                              # Hd 128 three K + V stages of KT keys fill the 48 KB of static shared memory)
MIN_PART_KEYS = 64            # keys a split part holds at least (fewer: the merge costs more than it spreads)
REDUCE_THREADS = 128
# The decoder takes this kernel for decode steps of at least this many sequences: at one sequence its fixed
# latency loses ~1-2 us to attention_decode_tiled at short contexts (H200, bench/attention_decode.py).
MMA_DECODE_MIN_SEQS = 2
LOG2E = 1.4426950408889634
NEG_INF = np.float32(-np.inf)
_merge = part_merger(base2=True)   # the partials' maxima are base 2, as the softmax keeps them
ZERO = np.float32(0.0)
_LO32 = np.uint64(0xFFFFFFFF)


def supports(kv_dtype, head_dim: int, block_size: int, group: int) -> bool:
    """Whether this kernel runs a decode step: bf16 pools, Hd 16, 32, 64 or 128 (a power of two: a key row's 16-byte
    chunks must divide the block's threads and the swizzles must keep a chunk within its row), power-of-two blocks,
    at most MAX_GROUP query heads per kv head."""
    return (np.dtype(kv_dtype) == np.uint16 and head_dim in HEAD_DIMS and block_size > 0
            and block_size & (block_size - 1) == 0 and 1 <= group <= MAX_GROUP)


@cuda.jit(device=True, inline=True)
def part_bounds(context_len, q_pos, window, start, num_splits, min_keys):
    """(lo, hi, part, parts): the keys [lo, hi) the query attends to (positions <= q_pos, > q_pos - window when
    window > 0, among the context_len cached ones; from `start` on when window is 0, the keys before it being a
    shared prefix attended elsewhere) cut into `parts` parts of `part` keys (the last one shorter): at most
    num_splits of at least min_keys, rounded up to whole tiles. parts is 0 for an empty range."""
    hi = min(context_len, q_pos + 1)
    lo = max(0, q_pos - window + 1) if window > 0 else start
    n = max(hi - lo, 0)
    part = max((n + num_splits - 1) // num_splits, min_keys, 1)
    part = (part + KT - 1) // KT * KT
    return lo, hi, part, (n + part - 1) // part


# What a block of the kernel attends (`_build`'s mode): PLAIN, its sequence's keys; AFTER_SHARED, its sequence's keys
# from starts[s] on (the shared prefix before them is another launch's), always as a partial when there is one;
# SHARED, the prefix [0, starts[s]) of a leader sequence s for each of its members (members[s, :], -1 padded),
# their query heads side by side in the mma's A rows (row = member * group + head), as partials.
PLAIN, AFTER_SHARED, SHARED = 0, 1, 2


@functools.cache
def _build(head_dim: int, rows2: bool, stages: int, mode: int = PLAIN):
    """The kernel for head size head_dim; rows2: more than 8 A rows in use (groups of more than 8 heads, or shared
    prefixes). Without them the row-(g + 8) halves of the fragments are constant zeros that the compiler drops,
    with their registers. stages: K/V tiles in shared memory (stages - 1 in flight while one is computed). mode:
    PLAIN, AFTER_SHARED or SHARED (above)."""
    lay = tile_layout(KT, head_dim, THREADS)
    row_u64, row_u32, tile_u64, tile_u32, copies, swz = (lay.row_u64, lay.row_u32, lay.tile_u64, lay.tile_u32,
                                                         lay.copies, lay.swz)
    nks = head_dim // 16                   # k-steps of Q K^T, and n-tile pairs of P V
    qa_len, acc_len = 4 * nks, 8 * nks     # array sizes must be closure constants, not expressions
    k_len, v_len = stages * tile_u64, stages * tile_u32
    m_at = MAX_GROUP * head_dim            # warp 1's row maxima in vs after its accumulator rows, then its sums
    l_at = m_at + MAX_GROUP
    halves = 2 if rows2 else 1             # A rows g and g + 8, or g alone
    prime, advance = tile_pipeline(KT, head_dim, THREADS, stages)
    pv = pv_product(head_dim, rows2)

    def attention_decode_mma_kernel(q, k_words, v_words, block_tables, context_lens, positions, starts, members,
                                    block_shift, num_kv_heads, window, qscale, min_keys, out, part_out, part_ml):
        """q: [S, H, Hd] float32; k_words, v_words: [NB * BS * Hkv * Hd / 2] uint32 views of the bf16 pools
        [NB, BS, Hkv, Hd]; block_tables [S, max_blocks], context_lens [S], positions [S] int32; starts [S],
        members [S, M] int32: the shared prefixes (read by the AFTER_SHARED and SHARED modes only); block_shift:
        log2(BS), num_kv_heads, window (0 = none), min_keys: int32; qscale: scale * log2(e), float32. out [S, H, Hd]
        float32 (written when the sequence's keys make one part, and it has no shared prefix); part_out
        [S, H, P, Hd], part_ml [S, H, P, 2] float32 (otherwise). Grid (S, Hkv, P), block (THREADS,)."""
        s = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        split = cuda.blockIdx.z
        group = q.shape[1] // num_kv_heads
        h0 = kvh * group
        rows = group                             # A rows in use
        if mode == SHARED:                       # a leader's members, its own sequence first; others return
            n_members = 0
            while n_members < members.shape[1] and members[s, n_members] >= 0:
                n_members += 1
            if n_members == 0 or window > 0:
                return
            rows = n_members * group
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        # over a shared prefix, the (sequence, head) of this lane's A rows g and g + 8 (divided once)
        seq_lo, head_lo, seq_hi, head_hi = s, h0, s, h0
        if mode == SHARED:
            if g < rows:
                seq_lo, head_lo = members[s, g // group], h0 + g % group
            if g + 8 < rows:
                seq_hi, head_hi = members[s, (g + 8) // group], h0 + (g + 8) % group
        # A fragments of q (rows g, g + 8; head dims permuted), loaded while the context is read
        qa = cuda.local.array(qa_len, types.uint32)
        for kk in range(nks):
            for half in range(2):
                row = g + 8 * half
                x0 = x1 = x2 = x3 = np.float32(0.0)
                if row < rows:
                    d = 16 * kk + 4 * t
                    seq, head = s, h0 + row
                    if mode == SHARED:
                        seq, head = (seq_lo, head_lo) if half == 0 else (seq_hi, head_hi)
                    x0 = q[seq, head, d] * qscale
                    x1 = q[seq, head, d + 1] * qscale
                    x2 = q[seq, head, d + 2] * qscale
                    x3 = q[seq, head, d + 3] * qscale
                qa[4 * kk + half] = pack(x0, x1) if rows2 or half == 0 else np.uint32(0)
                qa[4 * kk + 2 + half] = pack(x2, x3) if rows2 or half == 0 else np.uint32(0)
        if mode == SHARED:
            start = starts[s]
            lo, hi, part, parts = part_bounds(start, start - 1, 0, 0, cuda.gridDim.z, min_keys)
            single = False
        elif mode == AFTER_SHARED:
            start = starts[s] if window == 0 else 0
            lo, hi, part, parts = part_bounds(context_lens[s], positions[s], window, start, cuda.gridDim.z, min_keys)
            single = parts <= 1 and start == 0   # else this part's unnormalised partial
        else:
            lo, hi, part, parts = part_bounds(context_lens[s], positions[s], window, 0, cuda.gridDim.z, min_keys)
            single = parts <= 1
        if split >= max(parts, 1):               # block-uniform: no part here (an empty range: split 0 writes 0)
            return
        k_lo = lo + split * part
        k_hi = min(k_lo + part, hi)
        n_tiles = (max(k_hi - k_lo, 0) + KT - 1) // KT

        acc = cuda.local.array(acc_len, types.float32)  # per n-tile pair c: even-d tile c0..c3, odd-d tile c0..c3
        for j in range(acc_len):
            acc[j] = np.float32(0.0)
        sc = cuda.local.array(8, types.float32)        # S, then P, of the warp's 16 keys: two n-tiles' c0..c3
        m0 = m1 = NEG_INF                              # running max (base 2) of rows g and g + 8
        l0 = l1 = np.float32(0.0)                      # this lane's share of their running sums

        ks = cuda.shared.array(k_len, types.uint64, alignment=STAGE_ALIGN)
        vs = cuda.shared.array(v_len, types.uint32, alignment=STAGE_ALIGN)
        offs = cuda.local.array(copies, types.int64)
        row_words = np.int64(num_kv_heads * row_u32)
        head_word = np.int64(kvh * row_u32)
        prime(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, n_tiles, block_shift, row_words, head_word, offs)
        k_swz = (2 * (g % 4)) & swz               # K rows 16 * warp + 8j + g: key % 4 == g % 4
        for it in range(n_tiles):
            stage = advance(ks, vs, k_words, v_words, block_tables, s, k_lo, k_hi, it, n_tiles, block_shift,
                            row_words, head_word, offs)
            k0 = k_lo + it * KT + 16 * warp       # the warp's first key

            for j in range(8):
                sc[j] = np.float32(0.0)
            for j in range(2):
                base = stage * tile_u64 + (16 * warp + 8 * j + g) * row_u64 + t % 2
                for kk in range(nks):
                    kw = ld_shared(ks, base + 2 * ((2 * kk + t // 2) ^ k_swz))
                    sc[4 * j], sc[4 * j + 1], sc[4 * j + 2], sc[4 * j + 3] = mma(
                        qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3],
                        np.uint32(kw & _LO32), np.uint32(kw >> np.uint64(32)),
                        sc[4 * j], sc[4 * j + 1], sc[4 * j + 2] if rows2 else ZERO, sc[4 * j + 3] if rows2 else ZERO)
            if k0 + 16 > k_hi:                    # the part's last tile: keys past its end are not attended
                for j in range(2):
                    for e in range(2):
                        if k0 + 8 * j + 2 * t + e >= k_hi:
                            sc[4 * j + e] = NEG_INF
                            sc[4 * j + 2 + e] = NEG_INF
            mx0 = max(m0, quad_max(max(max(sc[0], sc[1]), max(sc[4], sc[5]))))
            base0 = mx0 if mx0 > NEG_INF else ZERO   # no key yet: every p is 0
            alpha0 = exp2(m0 - base0)
            m0 = mx0
            l0 *= alpha0
            alpha1 = ZERO
            if rows2:
                mx1 = max(m1, quad_max(max(max(sc[2], sc[3]), max(sc[6], sc[7]))))
                base1 = mx1 if mx1 > NEG_INF else ZERO
                alpha1 = exp2(m1 - base1)
                m1 = mx1
                l1 *= alpha1
            for j in range(2):
                for e in range(2):
                    sc[4 * j + e] = exp2(sc[4 * j + e] - base0)
                    l0 += sc[4 * j + e]
                    if rows2:
                        sc[4 * j + 2 + e] = exp2(sc[4 * j + 2 + e] - base1)
                        l1 += sc[4 * j + 2 + e]
            for j in range(2 * nks):
                acc[4 * j] *= alpha0
                acc[4 * j + 1] *= alpha0
                if rows2:
                    acc[4 * j + 2] *= alpha1
                    acc[4 * j + 3] *= alpha1
            pa0 = pack(sc[0], sc[1])
            pa1 = pack(sc[2], sc[3]) if rows2 else np.uint32(0)
            pa2 = pack(sc[4], sc[5])
            pa3 = pack(sc[6], sc[7]) if rows2 else np.uint32(0)
            pv(vs, stage * tile_u32 + (16 * warp + 2 * t) * row_u32, pa0, pa1, pa2, pa3, acc)
            cuda.syncthreads()                    # the stage is read by both warps before it is refilled

        # merge the warps: warp 1 leaves its rows' (max, sum, accumulators) in the stages' shared memory, as float
        # bits (every copy has landed and every warp is past its last tile: the loop's closing barrier)
        l0 = quad_sum(l0)
        if rows2:
            l1 = quad_sum(l1)
        if warp == 1:
            if t == 0:
                vs[m_at + g] = f32_as_u32(m0)
                vs[m_at + g + 8] = f32_as_u32(m1)
                vs[l_at + g] = f32_as_u32(l0)
                vs[l_at + g + 8] = f32_as_u32(l1)
            for c in range(nks):
                for half in range(halves):
                    at = (g + 8 * half) * head_dim + 16 * c + 4 * t
                    vs[at] = f32_as_u32(acc[8 * c + 2 * half])
                    vs[at + 1] = f32_as_u32(acc[8 * c + 4 + 2 * half])
                    vs[at + 2] = f32_as_u32(acc[8 * c + 1 + 2 * half])
                    vs[at + 3] = f32_as_u32(acc[8 * c + 5 + 2 * half])
        cuda.syncthreads()
        if warp == 0:
            for half in range(halves):
                row = g + 8 * half
                if row < rows:
                    seq, h = s, h0 + row
                    if mode == SHARED:
                        seq, h = (seq_lo, head_lo) if half == 0 else (seq_hi, head_hi)
                    mine = m0 if half == 0 else m1
                    other = u32_as_f32(vs[m_at + row])
                    mx = max(mine, other)
                    base = mx if mx > NEG_INF else ZERO
                    f_mine = exp2(mine - base)
                    f_other = exp2(other - base)
                    total = (l0 if half == 0 else l1) * f_mine + u32_as_f32(vs[l_at + row]) * f_other
                    inv = np.float32(1.0)
                    if single:
                        inv = np.float32(1.0) / total if total > 0 else ZERO
                    for c in range(nks):
                        d = 16 * c + 4 * t
                        at = row * head_dim + d              # warp 1's accumulators of these 4 head dims
                        o0 = (acc[8 * c + 2 * half] * f_mine + u32_as_f32(vs[at]) * f_other) * inv
                        o1 = (acc[8 * c + 4 + 2 * half] * f_mine + u32_as_f32(vs[at + 1]) * f_other) * inv
                        o2 = (acc[8 * c + 1 + 2 * half] * f_mine + u32_as_f32(vs[at + 2]) * f_other) * inv
                        o3 = (acc[8 * c + 5 + 2 * half] * f_mine + u32_as_f32(vs[at + 3]) * f_other) * inv
                        if single:
                            out[seq, h, d] = o0
                            out[seq, h, d + 1] = o1
                            out[seq, h, d + 2] = o2
                            out[seq, h, d + 3] = o3
                        else:
                            part_out[seq, h, split, d] = o0
                            part_out[seq, h, split, d + 1] = o1
                            part_out[seq, h, split, d + 2] = o2
                            part_out[seq, h, split, d + 3] = o3
                    if not single and t == 0:
                        part_ml[seq, h, split, 0] = mx
                        part_ml[seq, h, split, 1] = total

    return attention_decode_mma_kernel, cached_jit(attention_decode_mma_kernel)


def attention_decode_mma_reduce_kernel(context_lens, positions, window, min_keys, part_out, part_ml, out):
    """Merges the split-K partials of sequences whose keys made more than one part: part_out [S, H, P, Hd],
    part_ml [S, H, P, 2] (max in base 2, sum) float32 -> out [S, H, Hd] float32; context_lens, positions [S]
    int32, window, min_keys int32 as given to the attention kernel. Grid (S, H), block (REDUCE_THREADS,)."""
    s = cuda.blockIdx.x
    parts = part_bounds(context_lens[s], positions[s], window, 0, part_out.shape[2], min_keys)[3]
    if parts > 1:                                # else the attention kernel wrote this sequence's out
        _merge(part_out, part_ml, parts, part_out, part_ml, 0, s, cuda.blockIdx.y, out)


_reduce = cached_jit(attention_decode_mma_reduce_kernel)


def launch_attention_decode_mma(q, k_pool, v_pool, block_tables, context_lens, positions, window: int, scale: float,
                                out, part_out=None, part_ml=None, stream=0, min_keys: int = MIN_PART_KEYS,
                                stages: int = STAGES) -> None:
    """launch_attention_decode's arguments (q: [S, H, Hd] float32; k_pool, v_pool: [NB, BS, Hkv, Hd] uint16 bf16
    bits, `supports` holding; block_tables [S, max_blocks], context_lens, positions [S] int32; window 0 = none;
    out [S, H, Hd] float32; split-K workspaces part_out [S, H, P, Hd], part_ml [S, H, P, 2] float32 or None);
    min_keys: the fewest keys of a split part; stages: shared-memory tile stages (2 or 3)."""
    num_seqs, num_heads, head_dim, num_kv_heads, block_size, splits = check_arguments(
        "attention_decode_mma", q, k_pool, v_pool, block_tables, context_lens, positions, out, part_out, part_ml)
    if not supports(k_pool.dtype, head_dim, block_size, num_heads // num_kv_heads):
        raise ValueError(f"attention_decode_mma: no kernel for {np.dtype(k_pool.dtype).name} pools, head size "
                         f"{head_dim}, blocks of {block_size}, {num_heads // num_kv_heads} heads per kv head")
    if stages not in (2, 3):
        raise ValueError(f"attention_decode_mma: stages must be 2 or 3, got {stages}")
    if num_seqs == 0:
        return
    if splits == 1:      # the partial arguments are never touched: pass `out` views of the right rank
        part_out = part_ml = out.reshape(num_seqs, num_heads, 1, head_dim)
    # PLAIN reads no shared prefixes: context_lens and block_tables stand in for starts and members
    _build(head_dim, num_heads // num_kv_heads > 8, stages)[1][(num_seqs, num_kv_heads, splits), THREADS, stream](
        q, k_pool.reshape(-1).view(np.uint32), v_pool.reshape(-1).view(np.uint32), block_tables, context_lens,
        positions, context_lens, block_tables, np.int32(block_size.bit_length() - 1), np.int32(num_kv_heads),
        np.int32(window), np.float32(scale * LOG2E), np.int32(min_keys), out, part_out, part_ml)
    if splits > 1:
        _reduce[(num_seqs, num_heads), REDUCE_THREADS, stream](
            context_lens, positions, np.int32(window), np.int32(min_keys), part_out, part_ml, out)


def sm90_signatures():
    """(python function, numba signature): Hd 128 with groups of up to 8 and of up to 16 heads, Hd 64, three stages,
    the reduce."""
    f32_3d, f32_4d, i32, u32 = types.float32[:, :, ::1], types.float32[:, :, :, ::1], types.int32, types.uint32[::1]
    sig = (f32_3d, u32, u32, i32[:, ::1], i32[::1], i32[::1], i32[::1], i32[:, ::1], i32, i32, i32, types.float32,
           i32, f32_3d, f32_4d, f32_4d)
    builds = ((128, False, STAGES), (128, True, STAGES), (64, False, STAGES), (128, False, 3))
    return [(_build(*b)[0], sig) for b in builds] + [
        (attention_decode_mma_reduce_kernel, (i32[::1], i32[::1], i32, i32, f32_4d, f32_4d, f32_3d))]
