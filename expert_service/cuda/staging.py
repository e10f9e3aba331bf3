"""Staging a step for the cuda runner: the token buckets non-decode steps are padded to, where padding sequences
end, the step's metadata written into pinned host staging and uploaded as one prefix of it (workspace.py), the keys
of the decode graphs, and the steps of no real sequence that the warm-up stages."""

from __future__ import annotations

import numpy as np

from expert_service.cuda.shared_prefix import find_shared_prefixes
from expert_service.cuda.workspace import stage_routed_ids
from expert_service.engine.step import ForwardBatch

# routing=lut: the plan goes in a second copy when the unused block_tables rows before it exceed this many int32s
# (64 KiB: a few microseconds of PCIe either way; not tuned on the GPU)
PLAN_COPY_GAP = 16384
# Decode-only steps are padded to one of these batch sizes, each replaying a graph of its own.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def decode_key(bucket: int, shared: bool) -> int | tuple[int, bool]:
    """The graph of a decode step padded to `bucket` sequences: its own, or one more when its sequences share
    prefix blocks (attention_decode_shared's launches)."""
    return (bucket, True) if shared else bucket


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts non-decode steps are padded to: powers of two and 1.5x powers of two below max_tokens (at most
    a third of a padded step is padding), then max_tokens."""
    sizes = {b for k in range(max_tokens.bit_length()) for b in (1 << k, 3 << k >> 1) if b < max_tokens}
    return sorted(sizes | {max_tokens})


def padding_seq_starts(n: int, T: int, count: int, one_each: bool) -> np.ndarray:
    """Ends of `count` padding sequences after n real tokens of a step padded to T. one_each (a decode bucket: as
    many padding tokens as sequences): one token each, as attention_decode reads them. Otherwise (a token bucket):
    the first holds every padding token and the others are empty, so the padding costs the prefill attention one
    run of tiles, not one per sequence slot."""
    if one_each:
        assert T - n == count, (n, T, count)
        return n + np.arange(1, count + 1)
    return np.full(count, T)


def stage_step(
    ws,
    batch: ForwardBatch,
    T: int,
    S: int,
    R: int,
    max_blocks_per_seq: int,
    stream_handle,
    plan: tuple[list[int], int] | None = None,
    table_rows: int | None = None,
    token_bucket: bool = False,
    shared_block_size: int = 0,
) -> int:
    """Step metadata into ws's pinned staging (padded to T tokens / S sequences), then to the device. Padding
    sequences (`padding_seq_starts`) take one padding token each, or with token_bucket the first takes them all
    and the rest are empty; they attend to nothing and write no KV. table_rows: the block_tables rows to upload
    (default S; rows past them are never read). plan (routing=lut): the MoE layers and top-k its routed
    experts are staged for. shared_block_size (a decode step of an engine laid out for shared prefixes: the KV
    block size): the groups of sequences sharing prefix blocks are staged too (shared_prefix.py). Returns the
    number of those groups (0 without shared_block_size)."""
    h = ws.host
    n, s = len(batch.token_ids), len(batch.context_lens)
    h["token_ids"][:n] = batch.token_ids
    h["token_ids"][n:T] = 0
    if batch.fed_rows is None:
        h["feed_rows"][:T] = -1
    else:
        h["feed_rows"][:n] = batch.fed_rows
        h["feed_rows"][n:T] = -1
    h["positions"][:n] = batch.positions
    h["positions"][n:T] = 0
    h["slot_mapping"][:n] = batch.slot_mapping
    h["slot_mapping"][n:T] = -1  # padding writes no KV
    h["seq_starts"][: s + 1] = batch.seq_starts
    h["seq_starts"][s + 1 : S + 1] = padding_seq_starts(n, T, S - s, one_each=not token_bucket)
    h["context_lens"][:s] = batch.context_lens
    h["context_lens"][s:S] = 0  # padding attends to nothing
    r = min(len(batch.logits_rows), R)
    h["logits_rows"][:r] = batch.logits_rows[:r]
    h["logits_rows"][r:R] = np.arange(r, R) % max(T, 1)
    for i, table in enumerate(batch.block_tables):
        h["block_tables"][i, : len(table)] = table
    groups = 0
    if shared_block_size:
        groups = find_shared_prefixes(
            h["block_tables"], batch.context_lens, shared_block_size, h["share_starts"][:S], h["share_members"][:S]
        )
    meta = ws.metadata
    tables_end = meta.end_of("block_tables", min(S, table_rows or S) * max_blocks_per_seq)
    if plan is not None:  # the plan, behind the whole block_tables array: one copy unless that is long
        moe_layers, top_k = plan
        n_ids = stage_routed_ids(h["routed_ids"], batch.routed_experts, moe_layers, n, T, top_k)
        start = meta.offsets["routed_ids"]
        if start - tables_end > PLAN_COPY_GAP:
            meta.upload(tables_end, stream_handle)
            meta.upload(n_ids, stream_handle, start=start)
        else:
            meta.upload(start + n_ids, stream_handle)
        return groups
    meta.upload(tables_end, stream_handle)
    return groups


def warmup_batch(T: int, span: int, block_size: int, logits: bool) -> ForwardBatch:
    """A warm-up step of T zero tokens in as few sequences of at most `span` tokens as hold them: they read the
    zeroed KV pool and write none; with `logits`, each sequence's last position is a logits row."""
    lens = np.diff(np.linspace(0, T, -(-T // span) + 1).astype(np.int64))
    ends = np.cumsum(lens)
    return ForwardBatch(
        token_ids=np.zeros(T, np.int64),
        positions=np.concatenate([np.arange(n, dtype=np.int64) for n in lens]),
        seq_starts=np.concatenate([[0], ends]),
        context_lens=lens,
        block_tables=[np.zeros(-(-n // block_size), np.int64) for n in lens],
        slot_mapping=np.full(T, -1, np.int64),
        logits_rows=ends - 1 if logits else np.zeros(0, np.int64),
    )


def padding_batch() -> ForwardBatch:
    """A step of no sequences: stage_step pads it to any bucket (padding writes no KV, attends to nothing)."""
    empty = np.zeros(0, np.int64)
    return ForwardBatch(
        token_ids=empty,
        positions=empty,
        seq_starts=np.zeros(1, np.int64),
        context_lens=empty,
        block_tables=[],
        slot_mapping=empty,
        logits_rows=empty,
    )
