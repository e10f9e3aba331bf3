"""attention_decode_shared (a shared prefix's KV read once per group of sequences) vs
expert_service.cpu.layers.attention.paged_attention, one query per sequence, on block tables whose sequences share
leading blocks as the prefix cache hands them out; the groups come from cuda.shared_prefix.find_shared_prefixes.
Runs under the CUDA simulator (the mma is emulated exactly); the GPU test takes the served shape. Tolerance as
attention_decode_mma's (bf16 q and P)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.layers.attention import paged_attention
from expert_service.cuda.shared_prefix import find_shared_prefixes
from expert_service.kernels.attention_decode_mma import KT, launch_attention_decode_mma
from expert_service.kernels.attention_decode_shared import launch_attention_decode_shared, max_members
from tests.helpers import assert_close, from_storage, nan_device, shared_cache

RTOL = 1e-2


def run_shared(
    rng,
    prefixes,
    own_lens,
    num_heads,
    num_kv_heads,
    head_dim=16,
    block_size=8,
    window=0,
    splits=2,
    shared_splits=3,
    min_keys=KT,
    expect_groups=None,
    edit=None,
):
    k_pool, v_pool, tables, ctx, lists = shared_cache(rng, prefixes, own_lens, block_size, num_kv_heads, head_dim)
    if edit is not None:  # edit(tables) rewrites some tables in place
        edit(tables)
        lists = [tables[i, : -(-int(n) // block_size)].astype(np.int64) for i, n in enumerate(ctx)]
    S = len(ctx)
    q = rng.standard_normal((S, num_heads, head_dim), dtype=np.float32)
    positions = ctx - 1
    scale = head_dim**-0.5
    starts = np.zeros(S, np.int32)
    members = np.zeros((S, max_members(num_heads, num_kv_heads)), np.int32)
    groups = find_shared_prefixes(tables, ctx, block_size, starts, members, min_keys=min_keys)
    if expect_groups is not None:
        assert groups == expect_groups, (groups, starts, members)
    want = paged_attention(
        q, from_storage(k_pool), from_storage(v_pool), np.arange(S + 1), ctx, lists, positions, scale, window
    )
    out = nan_device(q.shape)
    part = [nan_device((S, num_heads, splits, n)) for n in (head_dim, 2)]
    shared = [nan_device((S, num_heads, shared_splits, n)) for n in (head_dim, 2)]
    args = [cuda.to_device(a) for a in (q, k_pool, v_pool, tables, ctx, positions, starts, members)]
    launch_attention_decode_shared(*args, window, scale, out, *part, *shared, min_keys=min_keys)
    got = out.copy_to_host()
    assert_close(got, want, RTOL)
    return got, (k_pool, v_pool, tables, ctx, positions, q, scale, window, splits, min_keys), starts


def test_four_sequences_of_one_prefix_fill_the_rows_and_a_loner_runs_alone():
    # 2 heads per kv head: 8 members a block; 4 sequences over a 64-key prefix (3 split parts of it), their own
    # keys 1, 9 and 17 (a part, a partial tile, two tiles), and one sequence of another prompt
    rng = np.random.default_rng(10)
    prefixes = [("system", 64)] * 4 + [("other", 8)]
    got, _, starts = run_shared(rng, prefixes, [1, 9, 17, 30, 40], 4, 2, expect_groups=1)
    assert starts.tolist() == [64, 64, 64, 64, 0]


def test_groups_cut_at_the_rows_the_mma_holds():
    # 4 heads per kv head: 4 sequences a group, so 6 of one prefix make a group of 4 and one of 2
    rng = np.random.default_rng(11)
    run_shared(rng, [("p", 48)] * 6, [3, 5, 7, 11, 13, 2], 8, 2, min_keys=16, expect_groups=2)


def test_the_shared_answer_matches_the_unshared_kernel():
    rng = np.random.default_rng(13)
    got, (k_pool, v_pool, tables, ctx, positions, q, scale, window, splits, min_keys), _ = run_shared(
        rng, [("s", 96)] * 3, [4, 20, 33], 8, 2, splits=3, shared_splits=2
    )
    out = nan_device(q.shape)
    part = [nan_device((len(ctx), q.shape[1], splits, n)) for n in (q.shape[2], 2)]
    args = [cuda.to_device(a) for a in (q, k_pool, v_pool, tables, ctx, positions)]
    launch_attention_decode_mma(*args, window, scale, out, *part, min_keys=min_keys)
    np.testing.assert_allclose(got, out.copy_to_host(), rtol=0, atol=2e-3 * np.abs(got).max())


def test_a_sliding_window_layer_attends_its_window_alone():
    rng = np.random.default_rng(14)
    run_shared(rng, [("s", 64)] * 2, [10, 24], 4, 2, window=40, expect_groups=1)


def test_short_prefixes_are_attended_per_sequence():
    rng = np.random.default_rng(15)
    # a 16-key prefix is below min_keys: attended per sequence
    _, _, starts = run_shared(rng, [("s", 16)] * 3, [5, 6, 7], 4, 2, expect_groups=0)
    assert not starts.any()


def test_refuses_missing_workspaces():
    rng = np.random.default_rng(16)
    k_pool, v_pool, tables, ctx, _ = shared_cache(rng, [("s", 8)], [3], 8, 1, 16)
    q = cuda.to_device(rng.standard_normal((1, 2, 16), dtype=np.float32))
    dev = [cuda.to_device(a) for a in (k_pool, v_pool, tables, ctx, ctx - 1, np.zeros(1, np.int32))]
    with pytest.raises(ValueError, match="attention_decode_shared: part_out, part_ml, shared_out and shared_ml"):
        launch_attention_decode_shared(
            q,
            *dev,
            cuda.to_device(np.full((1, 2), -1, np.int32)),
            0,
            0.25,
            nan_device((1, 2, 16)),
            None,
            None,
            None,
            None,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,seqs,prefix", [(32, 8, 16, 2048), (32, 4, 16, 1024), (16, 16, 8, 512)])
def test_shared_gpu(num_heads, num_kv_heads, seqs, prefix):
    # the served shapes: mixtral (4 heads a kv head: groups of 4), qwen3moe (8: pairs), MHA (groups of 16)
    rng = np.random.default_rng(seqs + prefix)
    own = [int(x) for x in rng.integers(1, 200, seqs)]
    run_shared(
        rng,
        [("system", prefix)] * (seqs - 1) + [("other", 64)],
        own,
        num_heads,
        num_kv_heads,
        head_dim=128,
        block_size=16,
        splits=2,
        shared_splits=16,
        min_keys=64,
    )


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_every_group_size_maps_each_members_heads_to_its_rows(group):
    # two kv heads (the second's rows start at head `group`); a full group of 16 / group members (rows 8-15
    # carry the later members' heads), one more of the same prompt that makes a group with the next, interleaved
    # with a second prompt's pair, so leaders and members are not consecutive rows
    rng = np.random.default_rng(20 + group)
    width = max_members(2 * group, 2)
    names = ["a"] * (width + 2) + ["b"] * 2
    order = rng.permutation(len(names))
    prefixes = [(names[i], 32) for i in order]
    own = [int(x) for x in rng.integers(1, 20, len(names))]
    _, _, starts = run_shared(
        rng, prefixes, own, 2 * group, 2, block_size=4, splits=2, shared_splits=2, min_keys=16, expect_groups=3
    )
    assert (starts == 32).all()


def test_one_split_part_leaves_every_sequence_a_partial_or_its_out():
    # decode_split_count may give P = 1: the own keys are one part, a partial where a prefix is shared
    rng = np.random.default_rng(21)
    run_shared(rng, [("s", 64)] * 3 + [("t", 8)], [2, 40, 7, 50], 4, 1, splits=1, shared_splits=1, expect_groups=1)


def test_a_member_sharing_fewer_blocks_bounds_its_groups_prefix_and_reads_the_rest_as_its_own():
    # sequence 3 starts with the first four blocks of the others' prompt, then another prompt's: the group of four
    # shares 32 keys, and the other three attend keys 32-63 of their prompt as their own
    rng = np.random.default_rng(22)

    def edit(tables):
        tables[3, :4] = tables[0, :4]

    _, _, starts = run_shared(
        rng, [("s", 64)] * 3 + [("t", 64)], [5, 12, 30, 9], 4, 2, min_keys=16, expect_groups=1, edit=edit
    )
    assert starts.tolist() == [32, 32, 32, 32]
