"""Paged decode attention: one query token per sequence over its cached keys (numpy reference:
expert_service.cpu.layers.attention.paged_attention with one row per sequence).

Design (memory-bound: every K/V byte of a (sequence, kv head) is read once, by one block):
- Block = (sequence, tile of GT query heads sharing one kv head, split). GT is the whole GQA group when it is
  at most MAX_GROUP_TILE; larger groups (MQA) are cut into tiles, each re-reading the kv head (from L2).
- NWARPS warps take runs of KEYS_PER_WARP keys round-robin; a warp's lanes hold Hd/32 dims each (lane-major,
  so each load instruction reads one contiguous run of the key row). A warp issues the loads of its whole
  run before using them (one key at a time is latency-bound: a load's round trip per key). Warp reductions
  give the GT x KEYS_PER_WARP scores, then each warp updates its own online softmax (max, sum, accumulator)
  in float32 registers once per run. At the end the warps' states are merged through shared memory.
- Split-K: with few sequences (b=1) a grid of S * H/GT blocks leaves most SMs idle, so each sequence's key
  range is cut into parts (grid z: at most P). `decode_splits` picks P for a step of S sequences so the grid has
  about TARGET_BLOCKS blocks, given the longest context the model allows. At run time each sequence takes
  parts = min(P, its keys / min_keys) equal parts (`part_range`, from its context on the device, so one captured
  graph serves every length): short contexts use few blocks, and with one part the split-0 block writes `out`
  itself and the reduce returns at once. Otherwise each part writes an unnormalised partial output with its
  (max, sum) and the reduce kernel merges the parts that exist. Parts are equal per sequence, so long and short
  sequences and sliding windows balance.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels import programmatic
from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import WARP, loader, warp_sum

NWARPS = 4
THREADS = NWARPS * WARP
KEYS_PER_WARP = 4             # keys a warp loads per iteration (bytes in flight; registers: 2 * 4 * Hd/32)
MAX_GROUP_TILE = 4            # query heads per block; 8 no longer fits registers (PTX used local memory)
TARGET_BLOCKS = 528           # 4 blocks per SM on the H200's 132 SMs
MIN_PARTITION_TOKENS = 256    # decode_splits: P covers the longest context in parts of at least this many keys
MIN_PART_KEYS = 64            # keys a part holds at least at run time (part_range): fewer only add merge work
NEG_INF = np.float32(-np.inf)


def group_tile(group: int) -> int:
    """Largest divisor of the GQA group size that fits MAX_GROUP_TILE."""
    return max(g for g in range(1, min(group, MAX_GROUP_TILE) + 1) if group % g == 0)


def decode_splits(num_seqs: int, num_heads: int, num_kv_heads: int, max_context: int) -> int:
    """Number of key partitions P per sequence (1 = no split-K) for a batch whose longest context is
    max_context; the split workspaces are [S, H, P, Hd] and [S, H, P, 2] float32."""
    blocks = num_seqs * (num_heads // group_tile(num_heads // num_kv_heads))
    wanted = -(-TARGET_BLOCKS // blocks)
    return max(1, min(wanted, max_context // MIN_PARTITION_TOKENS))


@cuda.jit(device=True, inline=True)
def part_range(context_len, q_pos, window, split, num_splits, min_keys):
    """(k_lo, k_hi, parts): the keys [k_lo, k_hi) that part `split` attends to, of the keys at positions <= q_pos
    (and > q_pos - window when window > 0) among the context_len cached ones, cut into `parts` equal parts of at
    least min_keys keys, at most num_splits; empty for split >= parts (parts is 0 for no keys at all)."""
    hi = min(context_len, q_pos + 1)
    lo = max(0, q_pos - window + 1) if window > 0 else 0
    n = max(hi - lo, 0)
    part = max((n + num_splits - 1) // num_splits, min_keys, 1)
    k_lo = lo + split * part
    return k_lo, min(k_lo + part, hi), (n + part - 1) // part


@functools.cache
def row_lookup(copies: int, row_step: int):
    """Device function `lookup(block_tables, s, first_key, k_hi, block_shift, row_words, head_word, r0, offs)` of
    the kernels that stage key tiles by cp.async: offs[i] = the pool word of key row r0 + i * row_step of the tile at
    first_key for sequence s (blocks of 2**block_shift keys, row_words words a pool row, head_word the kv head's
    first), -1 from k_hi on; i < copies."""
    @cuda.jit(device=True, inline=True)
    def lookup(block_tables, s, first_key, k_hi, block_shift, row_words, head_word, r0, offs):
        mask = (np.int32(1) << block_shift) - np.int32(1)
        for i in range(copies):
            key = np.int32(first_key + r0 + i * row_step)
            offs[i] = -1
            if key < k_hi:
                blk = block_tables[s, key >> block_shift]
                offs[i] = ((np.int64(blk) << block_shift) + (key & mask)) * row_words + head_word
    return lookup


@functools.cache
def _build(kv_dtype, head_dim: int, gt: int):
    load = loader(kv_dtype)
    dpl = -(-head_dim // WARP)       # dims per lane
    acc_len = gt * dpl
    kv_len = KEYS_PER_WARP * dpl
    sm_states = NWARPS * gt          # shared-array sizes must be closure constants, not expressions
    sm_acc_len = NWARPS * gt * head_dim

    def attention_decode_kernel(q, k_pool, v_pool, block_tables, context_lens, positions, block_size,
                                num_kv_heads, window, scale, min_keys, out, part_out, part_ml):
        """q: [S, H, Hd] float32, the query of each sequence's one new token.
        k_pool, v_pool: [NB * BS * Hkv * Hd] flat views of the layer's pools [NB, BS, Hkv, Hd] (kv dtype).
        block_tables: [S, max_blocks] int32; context_lens: [S] int32 keys in the cache (0 = idle slot: out 0);
        positions: [S] int32 query position; keys at positions <= it (and > it - window if window > 0) count.
        block_size, num_kv_heads: int32; scale: float32 (head_dim ** -0.5).
        out: [S, H, Hd] float32 (written when gridDim.z == 1).
        part_out: [S, H, P, Hd], part_ml: [S, H, P, 2] float32 partials (written when gridDim.z == P > 1).
        Grid (S, H // GT, P), block (THREADS,)."""
        s = cuda.blockIdx.x
        h0 = cuda.blockIdx.y * gt
        split = cuda.blockIdx.z
        num_splits = cuda.gridDim.z
        kvh = h0 // (q.shape[1] // num_kv_heads)
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP

        k_lo, k_hi, parts = part_range(context_lens[s], positions[s], window, split, num_splits, min_keys)
        if split >= max(parts, 1):   # the whole block: a part this sequence's keys do not need
            return

        qr = cuda.local.array(acc_len, types.float32)
        acc = cuda.local.array(acc_len, types.float32)
        m = cuda.local.array(gt, types.float32)
        den = cuda.local.array(gt, types.float32)
        kr = cuda.local.array(kv_len, types.float32)
        vr = cuda.local.array(kv_len, types.float32)
        sc = cuda.local.array(KEYS_PER_WARP, types.float32)
        for g in range(gt):
            m[g] = NEG_INF
            den[g] = 0.0
            for i in range(dpl):
                d = i * WARP + lane
                qr[g * dpl + i] = q[s, h0 + g, d] * scale if d < head_dim else np.float32(0.0)
                acc[g * dpl + i] = 0.0

        row = num_kv_heads * head_dim
        step = NWARPS * KEYS_PER_WARP
        # Same trip count for every warp: warp_sum needs all lanes (and, in the simulator, all threads).
        for it in range((max(k_hi - k_lo, 0) + step - 1) // step):
            first = k_lo + (it * NWARPS + warp) * KEYS_PER_WARP
            # Issue all KEYS_PER_WARP keys' loads before using any: the loop is latency-bound otherwise.
            for u in range(KEYS_PER_WARP):
                key = first + u
                base = np.int64(0)
                if key < k_hi:
                    blk = block_tables[s, key // block_size]
                    base = (np.int64(blk) * block_size + key % block_size) * row + kvh * head_dim
                for i in range(dpl):
                    d = i * WARP + lane
                    ok = key < k_hi and d < head_dim
                    kr[u * dpl + i] = load(k_pool, base + d) if ok else np.float32(0.0)
                    vr[u * dpl + i] = load(v_pool, base + d) if ok else np.float32(0.0)
            for g in range(gt):
                mx = m[g]
                for u in range(KEYS_PER_WARP):
                    dot = np.float32(0.0)
                    for i in range(dpl):
                        dot += qr[g * dpl + i] * kr[u * dpl + i]
                    score = warp_sum(dot)
                    sc[u] = score if first + u < k_hi else NEG_INF
                    mx = max(mx, sc[u])
                if mx > NEG_INF:         # warp-uniform: this warp had at least one key
                    alpha = math.exp(m[g] - mx)
                    den[g] *= alpha
                    for i in range(dpl):
                        acc[g * dpl + i] *= alpha
                    for u in range(KEYS_PER_WARP):
                        p = math.exp(sc[u] - mx)
                        den[g] += p
                        for i in range(dpl):
                            acc[g * dpl + i] += p * vr[u * dpl + i]
                    m[g] = mx

        # Merge the warps' softmax states: acc is relative to each warp's own max.
        sm_m = cuda.shared.array(sm_states, types.float32)
        sm_den = cuda.shared.array(sm_states, types.float32)
        sm_acc = cuda.shared.array(sm_acc_len, types.float32)
        for g in range(gt):
            if lane == 0:
                sm_m[warp * gt + g] = m[g]
                sm_den[warp * gt + g] = den[g]
            for i in range(dpl):
                d = i * WARP + lane
                if d < head_dim:
                    sm_acc[(warp * gt + g) * head_dim + d] = acc[g * dpl + i]
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, gt * head_dim, THREADS):
            g = e // head_dim
            d = e % head_dim
            mx = NEG_INF
            for w in range(NWARPS):
                mx = max(mx, sm_m[w * gt + g])
            total = np.float32(0.0)
            o = np.float32(0.0)
            if mx > NEG_INF:
                for w in range(NWARPS):
                    c = math.exp(sm_m[w * gt + g] - mx)
                    total += sm_den[w * gt + g] * c
                    o += sm_acc[(w * gt + g) * head_dim + d] * c
            if parts <= 1:
                out[s, h0 + g, d] = o / total if total > 0 else np.float32(0.0)
            else:
                part_out[s, h0 + g, split, d] = o
                if d == 0:
                    part_ml[s, h0 + g, split, 0] = mx
                    part_ml[s, h0 + g, split, 1] = total

    return attention_decode_kernel, cached_jit(attention_decode_kernel)


@functools.cache
def part_merger(base2: bool):
    """Device function `merge(a_out, a_ml, a_parts, b_out, b_ml, b_parts, s, h, out)` of the split-K reduce kernels:
    out[s, h] = the first a_parts partials of (s, h) in a_out / a_ml and the first b_parts in b_out / b_ml merged by
    their (max, sum) (maxima in base 2 when base2, as the tensor-core kernel's softmax keeps them), the block's
    threads striding over Hd. b: a second set of partials (those of a shared prefix), b_parts 0 when there is none."""
    @cuda.jit(device=True, inline=True)
    def weigh(part_out, part_ml, parts, s, h, d, mx, total, o):
        for p in range(parts):
            shift = part_ml[s, h, p, 0] - mx
            c = np.float32(math.exp2(shift)) if base2 else math.exp(shift)
            total += part_ml[s, h, p, 1] * c
            o += part_out[s, h, p, d] * c
        return total, o

    @cuda.jit(device=True, inline=True)
    def merge(a_out, a_ml, a_parts, b_out, b_ml, b_parts, s, h, out):
        mx = NEG_INF
        for p in range(a_parts):
            mx = max(mx, a_ml[s, h, p, 0])
        for p in range(b_parts):
            mx = max(mx, b_ml[s, h, p, 0])
        for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
            total = np.float32(0.0)
            o = np.float32(0.0)
            if mx > NEG_INF:
                total, o = weigh(a_out, a_ml, a_parts, s, h, d, mx, total, o)
                total, o = weigh(b_out, b_ml, b_parts, s, h, d, mx, total, o)
            out[s, h, d] = o / total if total > 0 else np.float32(0.0)
    return merge


_merge = part_merger(False)


@functools.cache
def _build_reduce(mode: int = 0):
    """(python kernel, jitted) of the split-K reduce; mode: the programmatic-launch variant
    (kernels/programmatic.py)."""
    prologue = programmatic.prologue(mode)

    def attention_decode_reduce_kernel(context_lens, positions, window, min_keys, part_out, part_ml, out):
        """Merge the split-K partials of the parts each sequence used (part_range: none when it used one, whose
        block wrote `out`): context_lens, positions [S] int32, window, min_keys int32 (the kernel's), part_out
        [S, H, P, Hd], part_ml [S, H, P, 2] (max, sum) float32 -> out [S, H, Hd] float32. Grid (S, H), block
        (THREADS,)."""
        prologue()
        s = cuda.blockIdx.x
        parts = part_range(context_lens[s], positions[s], window, 0, part_out.shape[2], min_keys)[2]
        if parts > 1:
            _merge(part_out, part_ml, parts, part_out, part_ml, 0, s, cuda.blockIdx.y, out)

    return attention_decode_reduce_kernel, programmatic.compiled(attention_decode_reduce_kernel, mode)


def check_arguments(name, q, k_pool, v_pool, block_tables, context_lens, positions, out, part_out, part_ml):
    """The launchers' shape / dtype / layout checks; returns (S, H, Hd, Hkv, block size, P)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    assert q.dtype == out.dtype == np.float32 and out.shape == q.shape, (q.dtype, out.dtype, out.shape)
    assert k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype and k_pool.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_tables.dtype == context_lens.dtype == positions.dtype == np.int32
    assert block_tables.shape[0] == context_lens.shape[0] == positions.shape[0] == num_seqs
    splits = 1 if part_out is None else part_out.shape[2]
    if splits > 1:
        assert part_out.shape == (num_seqs, num_heads, splits, head_dim) and part_out.dtype == np.float32
        assert part_ml.shape == (num_seqs, num_heads, splits, 2) and part_ml.dtype == np.float32
    for a in (q, k_pool, v_pool, block_tables, context_lens, positions, out):
        assert a.flags["C_CONTIGUOUS"], f"{name} needs contiguous arrays"
    return num_seqs, num_heads, head_dim, num_kv_heads, block_size, splits


def launch_attention_decode(q, k_pool, v_pool, block_tables, context_lens, positions, window: int, scale: float, out,
                     part_out=None, part_ml=None, stream=0, min_keys: int = MIN_PART_KEYS) -> None:
    """q: [S, H, Hd] float32; k_pool, v_pool: [NB, BS, Hkv, Hd] (float32, float16 or uint16 = bf16 bits);
    block_tables: [S, max_blocks] int32; context_lens, positions: [S] int32; window: 0 = none;
    out: [S, H, Hd] float32. Split-K workspaces part_out [S, H, P, Hd] and part_ml [S, H, P, 2] float32
    (P from decode_splits); None or P == 1 runs one kernel without them. min_keys: the fewest keys of a part."""
    num_seqs, num_heads, head_dim, num_kv_heads, block_size, splits = check_arguments(
        "attention_decode", q, k_pool, v_pool, block_tables, context_lens, positions, out, part_out, part_ml)
    if num_seqs == 0:
        return
    gt = group_tile(num_heads // num_kv_heads)
    kernel = _build(np.dtype(k_pool.dtype), head_dim, gt)[1]
    if splits == 1:      # the partial arguments are never touched: pass `out` views of the right rank
        part_out = part_ml = out.reshape(num_seqs, num_heads, 1, head_dim)
    kernel[(num_seqs, num_heads // gt, splits), THREADS, stream](
        q, k_pool.reshape(-1), v_pool.reshape(-1), block_tables, context_lens, positions, np.int32(block_size),
        np.int32(num_kv_heads), np.int32(window), np.float32(scale), np.int32(min_keys), out, part_out, part_ml)
    if splits > 1:
        reduce_parts(context_lens, positions, window, min_keys, part_out, part_ml, out, stream)


def reduce_parts(context_lens, positions, window: int, min_keys: int, part_out, part_ml, out, stream=0) -> None:
    """The split-K reduce of attention_decode and attention_decode_tiled (the same part_range)."""
    _build_reduce(programmatic.mode())[1][(out.shape[0], out.shape[1]), THREADS, stream](
        context_lens, positions, np.int32(window), np.int32(min_keys), part_out, part_ml, out)


def sm90_signatures():
    """(python function, numba signature) of the variants to compile for sm_90: every kv dtype at Hd=128 with
    GQA tiles 2 and 4, an odd head size, and the split-K reduce (also waiting)."""
    f32_3d, f32_4d, i32 = types.float32[:, :, ::1], types.float32[:, :, :, ::1], types.int32
    out = []
    variants = [(np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)]
    for (dtype, nb), head_dim, gt in [(v, 128, gt) for v in variants for gt in (2, 4)] + [(variants[2], 20, 3)]:
        out.append((_build(np.dtype(dtype), head_dim, gt)[0],
                    (f32_3d, nb[::1], nb[::1], i32[:, ::1], i32[::1], i32[::1], i32, i32, i32, types.float32, i32,
                     f32_3d, f32_4d, f32_4d)))
    for wait in (False, True):
        out.append((_build_reduce(wait)[0], (i32[::1], i32[::1], i32, i32, f32_4d, f32_4d, f32_3d)))
    return out
