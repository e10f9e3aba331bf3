"""A step's work as the ForwardBatch a decoder runs: positions, KV slots, block tables and logits rows."""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

import numpy as np

from expert_service.engine.step import ForwardBatch


def build_batch(
    work: list[tuple[int, np.ndarray, bool]],
    token_ids: np.ndarray,
    sequences: Mapping[int, Any],
    allocated: Mapping[int, list[int]],
    block_size: int,
    all_logits: bool = False,
    scored: Set[int] = frozenset(),
) -> ForwardBatch:
    """token_ids: the work's tokens concatenated (as Engine._check_step returns them); sequences: the engine's
    SequenceState of each (num_cached, block_array, which this refreshes); allocated: their block tables. Logits rows: each sampling
    sequence's last position, in work order, then the positions of the `scored` prompt chunks (all but a
    sampling chunk's last, which is its sampling row)."""
    positions, slots = np.empty(len(token_ids), np.int64), np.empty(len(token_ids), np.int64)
    tables: list[np.ndarray] = []
    context_lens: list[int] = []
    logits_rows: list[int] = []
    scored_rows: list[int] = []
    seq_starts = [0]
    for rid, tokens, wants_token in work:
        seq = sequences[rid]
        begin, start, n = seq_starts[-1], seq.num_cached, len(tokens)
        table = allocated[rid]
        if n == 1:  # decode: plain ints (numpy calls cost more than they save on one element)
            positions[begin] = start
            slots[begin] = table[start // block_size] * block_size + start % block_size
        else:
            pos = np.arange(start, start + n, dtype=np.int64)
            positions[begin : begin + n] = pos
            slots[begin : begin + n] = np.asarray(table, np.int64)[pos // block_size] * block_size + pos % block_size
        if seq.block_array is None or len(seq.block_array) != len(table):
            seq.block_array = np.asarray(table, dtype=np.int64)
        tables.append(seq.block_array)
        context_lens.append(start + n)
        seq_starts.append(begin + n)
        if all_logits:
            logits_rows.extend(range(begin, begin + n))
        elif wants_token:
            logits_rows.append(begin + n - 1)
        if rid in scored:
            scored_rows.extend(range(begin, begin + n - wants_token))
    return ForwardBatch(
        token_ids,
        positions,
        np.asarray(seq_starts, np.int64),
        np.asarray(context_lens, np.int64),
        tables,
        slots,
        np.asarray(logits_rows + scored_rows, dtype=np.int64),
    )
