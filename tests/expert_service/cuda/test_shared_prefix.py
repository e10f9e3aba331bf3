"""Shared prompt prefixes at decode (no GPU needed): which sequences of a step are grouped (cuda.shared_prefix), the
engines that lay the groups out, their buffers and their staging with the step's metadata."""

from types import SimpleNamespace

import numpy as np
import pytest

from common.models import config_from_hf
from expert_service.cuda.shared_prefix import MIN_SHARED_KEYS, find_shared_prefixes, shared_members
from expert_service.cuda.staging import stage_step
from expert_service.cuda.workspace import (
    METADATA,
    SHARE_METADATA,
    layout_workspace,
    packed_layout,
    shared_split_count,
    shared_split_views,
)
from expert_service.engine.cuda_options import EXPERIMENTAL, CudaOptions
from expert_service.engine.step import ForwardBatch
from expert_service.tools.tiny_model import tiny_hf_config

ON = CudaOptions(shared_prefix_attention=True)


def groups_of(tables, lens, block_size=8, width=4, min_keys=16):
    tables = np.asarray(tables, np.int32)
    starts, members = np.full(len(lens) + 1, 99, np.int32), np.full((len(lens) + 1, width), 99, np.int32)
    count = find_shared_prefixes(tables, np.asarray(lens), block_size, starts, members, min_keys=min_keys)
    return count, starts, members


def test_sequences_of_one_prefix_are_grouped_in_batch_order_and_padding_is_cleared():
    rng = np.random.default_rng(0)
    prefix = 20 + rng.permutation(100)[:6]  # six shared blocks (none the other prompt's), then each sequence's own
    tables = [np.concatenate([prefix, [200 + i, 300 + i]]) for i in range(3)]
    tables.insert(1, np.array([7, 8, 9, 10, 11, 12, 13, 14]))  # another prompt between them
    count, starts, members = groups_of(tables, [60, 64, 52, 49])
    assert count == 1
    assert starts.tolist() == [48, 0, 48, 48, 0]  # the padding row too: rows past the step are cleared
    assert members[0].tolist() == [0, 2, 3, -1] and (members[1:] == -1).all()


def test_a_group_shares_the_blocks_all_its_members_have():
    # a conversation's later turn holds the first turn's first six blocks, then its own: the group shares six
    tables = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 20, 21, 22, 0]]
    count, starts, members = groups_of(tables, [80, 60], width=8)
    assert count == 1 and starts.tolist() == [48, 48, 0] and members[0, :3].tolist() == [0, 1, -1]


def test_only_whole_blocks_before_the_current_token_are_shared():
    # identical tables through the block each current token is written to: only the blocks before it count
    count, starts, _ = groups_of([[5, 6, 7, 9], [5, 6, 7, 8]], [17, 24], min_keys=8)
    assert count == 1 and starts.tolist()[:2] == [16, 16]


def test_groups_hold_at_most_the_kernel_rows_and_short_or_lone_prefixes_are_not_grouped():
    tables = [[1, 2, 3, 50 + i] for i in range(7)]
    count, starts, members = groups_of(tables, [30] * 7, width=3)
    assert count == 2  # 3 + 3, then one alone
    assert starts[:7].tolist() == [24] * 6 + [0]
    assert members[0].tolist() == [0, 1, 2] and members[3].tolist() == [3, 4, 5] and (members[6] == -1).all()
    assert groups_of(tables[:2], [30, 30], min_keys=32)[0] == 0  # 24 shared keys: below min_keys
    assert groups_of([[1, 2, 3], [4, 2, 3]], [30, 30])[0] == 0  # different first blocks
    assert groups_of(tables[:2], [30, 30], width=1)[0] == 0  # one sequence a group: nothing to share
    idle = groups_of(np.zeros((4, 3)), [0, 0, 0, 0])  # idle slots alike in their unused tables
    assert idle[0] == 0 and not idle[1].any() and (idle[2] == -1).all()


def test_engines_that_lay_out_shared_prefixes():
    mixtral = config_from_hf(tiny_hf_config("mixtral"))  # 4 heads, 2 kv heads: groups of 8 sequences
    bf16 = np.dtype(np.uint16)
    assert "shared_prefix_attention" in EXPERIMENTAL and not CudaOptions().shared_prefix_attention
    assert shared_members(mixtral, bf16, 16, CudaOptions()) == 0  # off by default
    assert shared_members(mixtral, bf16, 16, ON) == 8
    assert shared_members(mixtral, np.dtype(np.float32), 16, ON) == 0  # no tensor-core decode attention
    assert shared_members(mixtral, bf16, 16, CudaOptions(shared_prefix_attention=True, mma_decode_attention=False)) == 0
    mha = config_from_hf({**tiny_hf_config("mixtral"), "num_attention_heads": 16, "num_key_value_heads": 1})
    assert shared_members(mha, bf16, 16, ON) == 0  # 16 heads fill the kernel's rows: a group of one


@pytest.mark.parametrize("S", [8, 64])
def test_the_workspace_holds_every_steps_groups_and_partials(S):
    config = config_from_hf({**tiny_hf_config("mixtral"), "max_position_embeddings": 32768})
    H, Hd = config.num_attention_heads, config.head_dim
    plain = layout_workspace(config, np.dtype(np.uint16), 256, S, 16, len(config.moe_layers))
    layout = layout_workspace(config, np.dtype(np.uint16), 256, S, 16, len(config.moe_layers), shared_members=8)
    assert set(layout) - set(plain) == {"prefix_part_out", "prefix_part_ml", *SHARE_METADATA}
    assert layout["share_starts"][0] == (S + 1,) and layout["share_members"][0] == (S + 1, 8)
    rows = layout["prefix_part_out"][0][0]
    assert rows == max(s * shared_split_count(config, s, 8) for s in range(1, S + 1))
    ws = SimpleNamespace(
        prefix_part_out=np.zeros((rows, H, Hd), np.float32), prefix_part_ml=np.zeros((rows, H, 2), np.float32)
    )
    for s in range(1, S + 1):
        out, ml = shared_split_views(ws, config, s, shared_split_count(config, s, 8))
        assert out.shape[:2] == ml.shape[:2] == (s, H) and out.base is not None
    # a shared expert's output buffer is another one (qwen2-moe: both laid out, neither replacing the other)
    qwen2 = config_from_hf({**tiny_hf_config("qwen2_moe"), "max_position_embeddings": 32768})
    both = layout_workspace(qwen2, np.dtype(np.uint16), 256, S, 16, len(qwen2.moe_layers), shared_members=8)
    assert both["shared_out"][0] == (256, qwen2.hidden_size)
    assert both["prefix_part_out"][0][1:] == (qwen2.num_attention_heads, qwen2.head_dim)
    # the groups ride in the step's one metadata upload: packed before block_tables
    names = METADATA[:-1] + SHARE_METADATA + METADATA[-1:]
    offsets, _ = packed_layout({n: layout[n][0] for n in names})
    assert offsets["share_members"] < offsets["block_tables"]


class _Metadata:
    """The packed metadata's host side without a device: uploads are recorded."""

    def __init__(self, names, layout):
        self.offsets, _ = packed_layout({n: layout[n][0] for n in names})
        self.uploads = []

    def end_of(self, name, elements):
        return self.offsets[name] + elements

    def upload(self, elements, stream_handle, start=0):
        self.uploads.append((start, elements))


def test_a_decode_step_stages_its_groups_before_its_block_tables():
    config = config_from_hf(tiny_hf_config("mixtral"))
    S, blocks = 4, 16
    layout = layout_workspace(config, np.dtype(np.uint16), 64, S, blocks, len(config.moe_layers), shared_members=8)
    names = METADATA[:-1] + SHARE_METADATA + METADATA[-1:]
    host = {n: np.full(layout[n][0], 77, np.int32) for n in names}
    ws = SimpleNamespace(host=host, metadata=_Metadata(names, layout))
    prefix = list(range(10, 10 + MIN_SHARED_KEYS // 16))
    tables = [np.array(prefix + [90]), np.array([5]), np.array(prefix + [91])]
    lens = np.array([len(prefix) * 16 + 3, 9, len(prefix) * 16 + 12])
    batch = ForwardBatch(
        token_ids=np.arange(3),
        positions=lens - 1,
        seq_starts=np.arange(4),
        context_lens=lens,
        block_tables=tables,
        slot_mapping=np.arange(3),
        logits_rows=np.arange(3),
    )
    assert stage_step(ws, batch, S, S, S, blocks, None, shared_block_size=16) == 1
    assert host["share_starts"][:S].tolist() == [MIN_SHARED_KEYS, 0, MIN_SHARED_KEYS, 0]
    assert host["share_members"][0].tolist()[:3] == [0, 2, -1] and (host["share_members"][1:S] == -1).all()
    assert ws.metadata.uploads == [(0, ws.metadata.offsets["block_tables"] + S * blocks)]
    host["share_starts"][:] = 77
    assert stage_step(ws, batch, S, S, S, blocks, None) == 0  # not a sharing step: the groups are left alone
    assert (host["share_starts"] == 77).all()


def reference_groups(tables, lens, block_size, width, min_keys):
    """The grouping rule written plainly: runs of one first block in batch order, cut into groups of width."""
    starts, members = np.zeros(len(lens), np.int32), np.full((len(lens), width), -1, np.int32)
    whole = [max(n - 1, 0) // block_size for n in lens]
    runs: dict[int, list[int]] = {}
    for i, n in enumerate(whole):
        if n * block_size >= min_keys:
            runs.setdefault(int(tables[i][0]), []).append(i)
    for run in runs.values():
        for at in range(0, len(run), width):
            group = run[at : at + width]
            if len(group) < 2:
                continue
            common = min(whole[m] for m in group)
            for m in group[1:]:
                common = min(common, next((j for j in range(common) if tables[m][j] != tables[group[0]][j]), common))
            if common * block_size >= min_keys:
                starts[group] = common * block_size
                members[group[0], : len(group)] = group
    return starts, members


@pytest.mark.parametrize("seed", range(6))
def test_the_grouping_matches_its_plain_statement_on_random_steps(seed):
    rng = np.random.default_rng(seed)
    S, width, block = int(rng.integers(2, 40)), int(rng.integers(2, 6)), 4
    prompts = [rng.integers(0, 50, int(rng.integers(1, 12))) for _ in range(int(rng.integers(1, 5)))]
    tables = np.full((S + 1, 20), 999, np.int32)
    lens = []
    for i in range(S):
        prompt = prompts[int(rng.integers(len(prompts)))]
        cut = int(rng.integers(0, len(prompt) + 1))  # some share only part of their prompt's blocks
        row = np.concatenate([prompt[:cut], 100 + i * 8 + np.arange(20)])[:20]
        tables[i] = row
        lens.append(int(rng.integers(0, 20 * block)))
    want_starts, want_members = reference_groups(tables, lens, block, width, 8)
    count, starts, members = groups_of(tables, lens, block_size=block, width=width, min_keys=8)
    np.testing.assert_array_equal(starts[:S], want_starts)
    np.testing.assert_array_equal(members[:S], want_members)
    assert count == int((want_members[:, 0] >= 0).sum()) and starts[S] == 0 and (members[S] == -1).all()


def test_a_group_always_shares_at_least_one_block():
    # min_keys 0: sequences whose current token is in their first block share nothing, and idle slots (context 0)
    # alike in their stale tables are no group either (the kernel takes starts > 0 for every member)
    count, starts, members = groups_of([[1, 2], [1, 3], [1, 4]], [5, 8, 0], min_keys=0)
    assert count == 0 and not starts.any() and (members == -1).all()
    count, starts, members = groups_of([[1, 2, 3], [1, 2, 4]], [17, 20], min_keys=0)
    assert count == 1 and starts[:2].tolist() == [16, 16] and members[0, :2].tolist() == [0, 1]
