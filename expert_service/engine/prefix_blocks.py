"""The engine's side of prefix caching: a new sequence starting on cached blocks, and the blocks a chunk
completes, or a running sequence's decodes filled, registered under the router's ids (kv_cache.BlockAllocator
keeps the index and reference counts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from common.errors import InvalidRequestError
from expert_service.engine.kv_cache import BlockAllocator
from expert_service.engine.step import PrefillInput


class _Cached(Protocol):
    num_cached: int


def attach_prefix(allocator: BlockAllocator, chunk: PrefillInput, owner: int) -> int:
    """Starts a new sequence's block table on the chunk's cached prefix blocks; returns the tokens they hold.
    Raises KeyError with the first block id that is not cached (nothing attached then)."""
    keys = [(owner, block_id) for block_id in chunk.prefix_block_ids]
    try:
        allocator.check_attach(keys)
    except KeyError as missing:
        raise KeyError(missing.args[0][1]) from None
    if keys:
        allocator.attach(chunk.request_id, keys)
    return len(keys) * allocator.block_size


def check_prefix_scoring(chunk: PrefillInput) -> None:
    """A new sequence scoring its prompt (prompt_logprobs) starts on no cached block: the prefix's positions would
    go unscored and its first computed token be scored as the prompt's first (NaN). Refused, not answered wrong."""
    if chunk.prefix_block_ids and chunk.sampling is not None and chunk.sampling.prompt_logprobs is not None:
        raise InvalidRequestError(
            "prompt_logprobs",
            f"sequence {chunk.request_id}: a sequence scoring its prompt cannot start on cached blocks",
        )


def cache_registrations(
    allocator: BlockAllocator, sequences: Mapping[int, _Cached], prefill: Sequence[PrefillInput], owner: int
) -> list[tuple[int, int, tuple[int, int]]]:
    """(sequence, block index, key) for every block a chunk completes and names an id for (id 0: not cached),
    checked before the step runs: one id per completed block, no id already taken. The sequences' cached
    lengths are those before the step."""
    block_size = allocator.block_size
    out: list[tuple[int, int, tuple[int, int]]] = []
    taken: set[tuple[int, int]] = set()  # this step's keys: a set, a 2,048-token chunk completes 128 blocks
    for chunk in prefill:
        if not chunk.cache_block_ids or chunk.request_id not in sequences:
            continue
        start = sequences[chunk.request_id].num_cached
        first, end = start // block_size, (start + len(chunk.token_ids)) // block_size
        if len(chunk.cache_block_ids) != end - first:
            raise InvalidRequestError(
                "cache_block_ids",
                f"sequence {chunk.request_id}: {len(chunk.cache_block_ids)} ids for {end - first} completed blocks",
            )
        for index, block_id in enumerate(chunk.cache_block_ids, first):
            if not block_id:
                continue
            key = (owner, block_id)
            if key in allocator.cached or key in taken:
                raise InvalidRequestError(
                    "cache_block_ids", f"sequence {chunk.request_id}: block id {block_id} is taken"
                )
            taken.add(key)
            out.append((chunk.request_id, index, key))
    return out


def sequence_block_registrations(
    allocator: BlockAllocator,
    sequences: Mapping[int, _Cached],
    blocks: np.ndarray,
    owner: int,
    owns: Callable[[int], bool],
    fed: Mapping[int, int],
    chunks: Sequence[PrefillInput] = (),
) -> list[tuple[int, int, tuple[int, int]]]:
    """(sequence, block index, key) for each (sequence, block index, block id) row of `blocks` [r, 3]: full blocks
    of running sequences, their K/V written by this step (`fed`: the tokens it runs for each sequence) or earlier
    ones, to cache under the router's ids once the step is launched. Skipped: a sequence the stream no longer holds
    (freed, failed), and a block not full, which a step refused as a whole left short (the router, sending this
    step before that refusal came back, fails the sequence when it does and drops the id). Refused: id 0, an id
    taken by another block or by a chunk of the step (`chunks`), a block named twice, a sequence the step
    prefills (its chunks name its blocks: a row would race their registration)."""
    prefilling = {chunk.request_id for chunk in chunks}
    out: list[tuple[int, int, tuple[int, int]]] = []
    # the chunks' ids, then each row's: sets, as a hostile step may carry 65,536 rows
    taken = {(owner, block_id) for chunk in chunks for block_id in chunk.cache_block_ids if block_id}
    named: set[tuple[int, int]] = set()
    for seq_id, index, block_id in blocks.tolist():
        if not block_id:
            raise InvalidRequestError("cache_sequence_blocks", f"sequence {seq_id}: block {index} has id 0")
        if seq_id in prefilling:
            raise InvalidRequestError("cache_sequence_blocks", f"sequence {seq_id} prefills in this step")
        seq = sequences.get(seq_id)
        if seq is None or not owns(seq_id) or index >= (seq.num_cached + fed.get(seq_id, 0)) // allocator.block_size:
            continue
        key = (owner, block_id)
        if not allocator.can_register(seq_id, index, key) or key in taken:
            raise InvalidRequestError("cache_sequence_blocks", f"sequence {seq_id}: block id {block_id} is taken")
        if (seq_id, index) in named:
            raise InvalidRequestError("cache_sequence_blocks", f"sequence {seq_id}: block {index} is named twice")
        taken.add(key)
        named.add((seq_id, index))
        out.append((seq_id, index, key))
    return out


def prefix_penalty_tokens(
    prefill: Sequence[PrefillInput], created: list[int], vocab_size: int, allocator: BlockAllocator
) -> dict[int, np.ndarray]:
    """The cached prefix tokens of the new sequences a repetition penalty counts; refuses such a sequence on
    cached blocks without them (its penalty would silently miss them), or tokens that do not fill its blocks. Any
    sent for a sequence without one (routers that predate InfoResponse.prefix_tokens_for_repetition_only) are
    ignored: presence and frequency count output tokens only."""
    out: dict[int, np.ndarray] = {}
    new = set(created)
    for chunk in prefill:
        if chunk.request_id not in new or not chunk.prefix_block_ids or chunk.sampling is None:
            continue
        if not chunk.sampling.penalties.counts_prompt:
            continue
        expected = len(chunk.prefix_block_ids) * allocator.block_size
        tokens = np.asarray(chunk.prefix_token_ids, np.int64)
        if len(tokens) != expected:
            raise InvalidRequestError(
                "prefix_token_ids",
                f"sequence {chunk.request_id}: a penalised sequence on {len(chunk.prefix_block_ids)} cached blocks "
                f"needs their {expected} tokens, got {len(tokens)}",
            )
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            raise InvalidRequestError(
                "prefix_token_ids", f"sequence {chunk.request_id}: ids must be in [0, {vocab_size})"
            )
        out[chunk.request_id] = tokens
    return out
