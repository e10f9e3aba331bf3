"""Which sequences of a decode step share a cached prefix, for attention_decode_shared: read from the step's block
tables on the host, as the step is staged. Sequences share a prefix when their block tables start with the same
block ids (the prefix cache hands the same blocks to every request of the same prompt prefix, and a block, once
shared, is never written), so the keys of those blocks are the same keys."""

from __future__ import annotations

import numpy as np

from common.model_config import ModelConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels.attention_decode_mma import supports
from expert_service.kernels.attention_decode_shared import max_members

# A prefix shorter than this many keys is attended per sequence: its partial would cost the merge more than reading
# it once saves (a split part of attention_decode_mma holds as many by default, CudaOptions.decode_part_keys). Not
# tuned on the GPU.
MIN_SHARED_KEYS = 64


def find_shared_prefixes(
    tables: np.ndarray,
    context_lens: np.ndarray,
    block_size: int,
    starts: np.ndarray,
    members: np.ndarray,
    min_keys: int = MIN_SHARED_KEYS,
) -> int:
    """Fills starts [S] and members [S, M] (int32, S >= len(context_lens): rows past the step's sequences are
    padding) for a decode step whose sequence i has context_lens[i] keys and block ids tables[i, :] (entries past
    its blocks are never read). Sequences whose tables begin with the same block are grouped, M at most to a
    group in batch order, each group led by its first member: members[leader] lists the group (leader first, -1
    padded), starts[m] = the keys of the blocks every member of the group has in common, counting only whole
    blocks before each member's current token (the block it writes this step is its own). Groups sharing fewer
    than min_keys keys (or than one block: min_keys 0 too), sequences in no group and padding get starts 0 and
    members rows of -1. Returns the number of groups."""
    min_keys = max(min_keys, 1)  # the kernel takes starts > 0 for every member of a group
    starts.fill(0)
    members.fill(-1)
    width = members.shape[1]
    whole = np.maximum(np.asarray(context_lens, dtype=np.int64) - 1, 0) // block_size  # blocks before each token
    seqs = np.flatnonzero(whole * block_size >= min_keys)
    if width < 2 or len(seqs) < 2:
        return 0
    # runs of the same first block (batch order within a run), cut into groups of `width`; vectorised, since
    # this runs on the host for every decode step
    order = seqs[np.argsort(tables[seqs, 0], kind="stable")]
    first = tables[order, 0]
    index = np.arange(len(order))
    run_start = np.maximum.accumulate(np.where(np.r_[True, first[1:] != first[:-1]], index, 0))
    lead = run_start + (index - run_start) // width * width  # each one's group leader, as an index of `order`
    grouped = np.bincount(lead, minlength=len(order))[lead] >= 2
    if not grouped.any():
        return 0
    seqs, leader, lead = order[grouped], order[lead[grouped]], lead[grouped]
    # the whole blocks a member has in common with its leader, then the group's least
    whole_of = whole[seqs]
    blocks = int(whole_of.max())
    differs = tables[seqs, :blocks] != tables[leader, :blocks]
    same = np.where(differs.any(axis=1), differs.argmax(axis=1), blocks)
    starts_at = np.flatnonzero(np.r_[True, lead[1:] != lead[:-1]])  # each group's first member in seqs
    common = np.minimum.reduceat(np.minimum(same, whole_of), starts_at)
    count = np.diff(np.r_[starts_at, len(seqs)])
    shared = np.repeat(common * block_size, count)
    kept = shared >= min_keys
    starts[seqs[kept]] = shared[kept]
    column = np.arange(len(seqs)) - np.repeat(starts_at, count)  # each member's place in its group
    members[leader[kept], column[kept]] = seqs[kept]
    return int((common * block_size >= min_keys).sum())


def shared_members(config: ModelConfig, kv_dtype, block_size: int, options: CudaOptions) -> int:
    """The sequences one group of attention_decode_shared holds on this engine: 0 where its options leave
    shared_prefix_attention off or its decode attention cannot take it (not on attention_decode_mma, or a kv head
    with as many query heads as the kernel's rows, so a group of one)."""
    group = config.num_attention_heads // config.num_key_value_heads
    if not (options.shared_prefix_attention and options.mma_decode_attention):
        return 0
    if not supports(kv_dtype, config.head_dim, block_size, group):
        return 0
    members = max_members(config.num_attention_heads, config.num_key_value_heads)
    return members if members >= 2 else 0
