"""Paged decode attention on tensor cores for a batch whose sequences share a cached prompt prefix (the same KV
blocks at the start of their block tables: a system prompt many requests send, the samples of one n > 1 request):
the prefix's keys and values are read once per group of sequences instead of once per sequence.

Decode attention reads every cached key of every sequence, so sixteen requests over one 2,048-token system prompt
read its KV sixteen times a layer. attention_decode_mma fills only `group` of the mma's 16 A rows (the query heads
of one kv head: 4 on Mixtral, 8 on Qwen3-MoE); here the heads of up to 16 / group sequences of the same prefix sit
side by side in those rows, so one pass over the prefix's tiles serves them all at the same instruction count.

Three launches (attention_decode_mma's body in two more modes, then a merge):
- SHARED, grid (S, Hkv, PS): block (s, kv head, split) of a leader s (members[s, 0] = s, then its members, -1
  padded; other rows all -1 and their blocks return) attends the keys [0, starts[s]) of its own block table for
  every member, split into at most PS parts, each written as an unnormalised partial (max in base 2, sum) to
  shared_out / shared_ml of the member's row.
- AFTER_SHARED, grid (S, Hkv, P): every sequence attends its keys from starts[s] on (all of them when
  starts[s] = 0, exactly as attention_decode_mma), as partials when it has a shared prefix.
- the reduce, grid (S, H): merges a sequence's own parts and its shared parts into out.
A layer with a sliding window attends its window alone (starts ignored, the SHARED blocks return).

Arguments the caller guarantees (`cuda/shared_prefix.py` builds them from the step's block tables): every member
m of leader s has starts[m] = starts[s] > 0, the same first starts[s] / BS blocks as s, and its query at a
position >= starts[s] (the prefix is whole blocks before its current token's); a sequence in no group has
starts = 0 and appears in no members row. Numerics: those of attention_decode_mma (bf16 q and P), the same
partials merged in another grouping: not bit-equal to the unshared kernel's outputs (the tests hold them within
2e-3 of the largest value).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, types

from expert_service.kernels.attention_decode import check_arguments, part_merger
from expert_service.kernels.attention_decode_mma import (
    AFTER_SHARED,
    LOG2E,
    MAX_GROUP,
    MIN_PART_KEYS,
    REDUCE_THREADS,
    SHARED,
    STAGES,
    THREADS,
    _build,
    part_bounds,
    supports,
)
from expert_service.kernels.jit_cache import cached_jit

_merge = part_merger(base2=True)


def max_members(num_heads: int, num_kv_heads: int) -> int:
    """Sequences one SHARED block serves: the mma's 16 A rows over the query heads of a kv head (1: no gain)."""
    return MAX_GROUP // (num_heads // num_kv_heads)


def attention_decode_shared_reduce_kernel(context_lens, positions, starts, window, min_keys, part_out, part_ml,
                                          shared_out, shared_ml, out):
    """Merges a sequence's own split-K partials (part_out [S, H, P, Hd], part_ml [S, H, P, 2]) with those of its
    shared prefix (shared_out [S, H, PS, Hd], shared_ml [S, H, PS, 2]; maxima in base 2) into out [S, H, Hd]
    float32; context_lens, positions, starts [S] int32, window, min_keys int32 as given to the attention launches.
    A sequence without a shared prefix whose keys made one part was written by its attention block. Grid (S, H),
    block (REDUCE_THREADS,)."""
    s = cuda.blockIdx.x
    start = starts[s] if window == 0 else 0
    own = part_bounds(context_lens[s], positions[s], window, start, part_out.shape[2], min_keys)[3]
    if start > 0:  # split 0 wrote a partial even for an empty own range
        shared = part_bounds(start, start - 1, 0, 0, shared_out.shape[2], min_keys)[3]
        _merge(part_out, part_ml, max(own, 1), shared_out, shared_ml, shared, s, cuda.blockIdx.y, out)
    elif own > 1:
        _merge(part_out, part_ml, own, shared_out, shared_ml, 0, s, cuda.blockIdx.y, out)


_reduce = cached_jit(attention_decode_shared_reduce_kernel)


def launch_attention_decode_shared(q, k_pool, v_pool, block_tables, context_lens, positions, starts, members,
                                   window: int, scale: float, out, part_out, part_ml, shared_out, shared_ml,
                                   stream=0, min_keys: int = MIN_PART_KEYS, stages: int = STAGES) -> None:
    """launch_attention_decode_mma's arguments (q: [S, H, Hd] float32; k_pool, v_pool: [NB, BS, Hkv, Hd] uint16
    bf16 bits; block_tables [S, max_blocks], context_lens, positions [S] int32; window 0 = none; out [S, H, Hd]
    float32; part_out [S, H, P, Hd], part_ml [S, H, P, 2] float32, required here: a sequence with a shared prefix
    always leaves partials) and the shared prefixes: starts [S] int32 (0 = none), members [S, M] int32 (M <=
    max_members; row s lists leader s's members, itself first, -1 padded), shared_out [S, H, PS, Hd], shared_ml
    [S, H, PS, 2] float32 (the prefix's partials, PS parts at most)."""
    num_seqs, num_heads, head_dim, num_kv_heads, block_size, splits = check_arguments(
        "attention_decode_shared", q, k_pool, v_pool, block_tables, context_lens, positions, out, part_out, part_ml)
    group = num_heads // num_kv_heads
    if not supports(k_pool.dtype, head_dim, block_size, group):
        raise ValueError(f"attention_decode_shared: no kernel for {np.dtype(k_pool.dtype).name} pools, head size "
                         f"{head_dim}, blocks of {block_size}, {group} heads per kv head")
    if part_out is None or shared_out is None or shared_ml is None:
        raise ValueError("attention_decode_shared: part_out, part_ml, shared_out and shared_ml are required")
    shared_splits = shared_out.shape[2]
    assert shared_out.shape == (num_seqs, num_heads, shared_splits, head_dim), shared_out.shape
    assert shared_ml.shape == (num_seqs, num_heads, shared_splits, 2), shared_ml.shape
    assert starts.shape == (num_seqs,) and starts.dtype == members.dtype == np.int32, (starts.shape, starts.dtype)
    assert members.shape[0] == num_seqs and 1 <= members.shape[1] <= max_members(num_heads, num_kv_heads)
    if stages not in (2, 3):
        raise ValueError(f"attention_decode_shared: stages must be 2 or 3, got {stages}")
    if num_seqs == 0:
        return
    k_words, v_words = k_pool.reshape(-1).view(np.uint32), v_pool.reshape(-1).view(np.uint32)
    shift, heads, win = np.int32(block_size.bit_length() - 1), np.int32(num_kv_heads), np.int32(window)
    qscale, keys = np.float32(scale * LOG2E), np.int32(min_keys)
    _build(head_dim, True, stages, SHARED)[1][(num_seqs, num_kv_heads, shared_splits), THREADS, stream](
        q, k_words, v_words, block_tables, context_lens, positions, starts, members, shift, heads, win, qscale, keys,
        out, shared_out, shared_ml)
    _build(head_dim, group > 8, stages, AFTER_SHARED)[1][(num_seqs, num_kv_heads, splits), THREADS, stream](
        q, k_words, v_words, block_tables, context_lens, positions, starts, members, shift, heads, win, qscale, keys,
        out, part_out, part_ml)
    _reduce[(num_seqs, num_heads), REDUCE_THREADS, stream](
        context_lens, positions, starts, win, keys, part_out, part_ml, shared_out, shared_ml, out)


def sm90_signatures():
    """(python function, numba signature): both modes at Hd 128 (groups of up to 8 heads) and Hd 64, the reduce."""
    f32_3d, f32_4d, i32 = types.float32[:, :, ::1], types.float32[:, :, :, ::1], types.int32
    u32, vec, mat = types.uint32[::1], i32[::1], i32[:, ::1]
    sig = (f32_3d, u32, u32, mat, vec, vec, vec, mat, i32, i32, i32, types.float32, i32, f32_3d, f32_4d, f32_4d)
    builds = ((128, True, STAGES, SHARED), (128, False, STAGES, AFTER_SHARED), (64, True, STAGES, SHARED))
    return [(_build(*b)[0], sig) for b in builds] + [
        (attention_decode_shared_reduce_kernel, (vec, vec, vec, i32, i32, f32_4d, f32_4d, f32_4d, f32_4d, f32_3d))]
