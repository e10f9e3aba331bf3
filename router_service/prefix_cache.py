"""Automatic prefix caching, the router's half: which full KV blocks are cached, under which ids, and which to
evict. Pure Python; the scheduler calls it and the worker's pool follows what the steps carry.

Design note. A block is named by a chained hash: sha256(parent's hash, its tokens), the root being a hash of
the model's identity and the request's cache salt, so equal hashes mean equal KV and different salts never
share. The router is the only authority: it gives each cached block a stream-local id (the worker never sees a
hash), tells the worker in a prompt chunk to register the blocks that chunk completes under new ids, names the
ids a new sequence starts on, and names the ids to evict. A registration counts only once the step carrying it
came back with that sequence unharmed; otherwise the id is evicted (a no-op on the worker when it never took
it). The worker therefore never holds a cached block the router does not know of, and the router never offers
one the worker lacks. A new stream (worker restart, reconnect) starts with an empty index on both sides.

Accounting. The scheduler's free blocks exclude blocks requests reserve and blocks the index holds. A request
reserves its prompt + max_new_tokens minus the blocks it starts on; a block it registers moves from its
reservation into the index (net zero). Index blocks no request holds are kept in LRU order and evicted only when
an admission needs their room. Only full prompt blocks are cached, and a hit is capped one token short of the
prompt, so the prompt's last token is always computed (its logits sample the first new token) and a shared
block is never written.

Requests racing for one prefix: a request whose next uncached block is being computed by a running request
(claimed) waits for it instead of computing it again, so n samples of one prompt, or clients sharing a
system prompt, prefill it once.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PrefixState:
    """One request's part in the cache (ScheduledRequest.prefix)."""

    hashes: list[bytes]  # its prompt's full blocks, chained
    may_hit: bool  # looks the cache up (False with prompt_logprobs: every prompt position must be scored)
    # computes blocks for others to wait on (False with prompt_logprobs: its prompt runs a few rows a step)
    may_claim: bool = True
    hit_ids: list[int] = field(default_factory=list)  # the cached blocks it starts on
    held_ids: list[int] = field(default_factory=list)  # cached blocks it holds a reference on
    claimed: set[int] = field(default_factory=set)  # block indices it computes for the cache
    in_transit: dict[int, int] = field(default_factory=dict)  # block id -> index: sent, not yet confirmed


@dataclass
class _Block:
    block_id: int
    refs: int


@dataclass
class _Registration:
    hash: bytes
    claimant: PrefixState  # the request that computes the block
    owner: PrefixState | None  # the same, None once it left


class PrefixCache:
    def __init__(self, block_size: int, namespace: bytes):
        self.block_size = block_size
        self.namespace = hashlib.sha256(b"colibri-prefix-v1\0" + namespace).digest()
        self.blocks: dict[bytes, _Block] = {}
        self._hash_of: dict[int, bytes] = {}  # block id -> hash, while in the index
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # unreferenced, oldest first
        self._claims: dict[bytes, PrefixState] = {}  # hash -> the request computing it
        self._registering: dict[int, _Registration] = {}  # block id -> registration in flight
        self._ids = itertools.count(1)
        self.pending_evictions: list[int] = []  # ids the next step tells the worker to drop
        # Counters for metrics, in tokens and blocks.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted = 0

    # ---- hashing ----
    def hashes(self, token_ids: list[int], salt: str = "") -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids`."""
        parent = hashlib.sha256(self.namespace + b"salt\0" + salt.encode()).digest() if salt else self.namespace
        data, width = np.asarray(token_ids, "<u4").tobytes(), 4 * self.block_size
        out = []
        for start in range(0, len(data) - width + 1, width):
            parent = hashlib.sha256(parent + data[start : start + width]).digest()
            out.append(parent)
        return out

    # ---- what the scheduler reads ----
    @property
    def num_cached_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._lru)

    def lookup(self, state: PrefixState, num_prompt_tokens: int) -> int | None:
        """How many leading blocks the request would start on, or None when it should wait: its next block
        is being computed by a running request."""
        if not state.may_hit:
            return 0
        usable = state.hashes[: (num_prompt_tokens - 1) // self.block_size]
        k = 0
        while k < len(usable) and usable[k] in self.blocks:
            k += 1
        if k < len(usable) and usable[k] in self._claims:
            return None
        return k

    def evictable_beyond(self, state: PrefixState, k: int) -> int:
        """Unreferenced blocks admission may evict, the request's own hits excluded."""
        return len(self._lru) - sum(1 for h in state.hashes[:k] if h in self._lru)

    # ---- admission, chunks, results ----
    def admit(self, state: PrefixState, k: int, num_prompt_tokens: int, shortfall: int) -> None:
        """The request starts on its first k cached blocks (referenced now), `shortfall` LRU blocks are evicted
        for its room, and it claims the uncached full blocks of its prompt no one else computes."""
        for h in state.hashes[:k]:
            block = self.blocks[h]
            block.refs += 1
            self._lru.pop(h, None)
            state.hit_ids.append(block.block_id)
        state.held_ids = list(state.hit_ids)
        for _ in range(shortfall):
            h, _ = self._lru.popitem(last=False)
            block_id = self.blocks.pop(h).block_id
            del self._hash_of[block_id]
            self.pending_evictions.append(block_id)
            self.num_evicted += 1
        if state.may_hit:
            self.num_query_tokens += num_prompt_tokens
            self.num_hit_tokens += k * self.block_size
        for index in range(k, len(state.hashes) if state.may_claim else k):
            h = state.hashes[index]
            if h not in self.blocks and h not in self._claims:
                self._claims[h] = state
                state.claimed.add(index)

    def chunk_block_ids(self, state: PrefixState, start: int, num_tokens: int) -> tuple[int, ...]:
        """One id per block the chunk [start, start + num_tokens) completes: a new id for a block the request
        claimed, 0 for one it does not cache."""
        bs = self.block_size
        ids = []
        for index in range(start // bs, (start + num_tokens) // bs):
            if index in state.claimed:
                block_id = next(self._ids)
                state.in_transit[block_id] = index
                self._registering[block_id] = _Registration(state.hashes[index], state, state)
                ids.append(block_id)
            else:
                ids.append(0)
        return tuple(ids)

    def settle(self, block_ids, ok: bool) -> tuple[int, int]:
        """The step carrying these registrations came back; ok: the sequence ran. Returns (blocks moved from
        a live request's reservation into the index, blocks to return to the free pool)."""
        moved = returned = 0
        for block_id in block_ids:
            reg = self._registering.pop(block_id, None)
            if reg is None:
                continue
            owner = reg.owner
            if owner is not None:
                index = owner.in_transit.pop(block_id)
                owner.claimed.discard(index)
            if self._claims.get(reg.hash) is reg.claimant:
                del self._claims[reg.hash]
            if not ok or reg.hash in self.blocks:  # refused, or cached meanwhile through another path
                self.pending_evictions.append(block_id)
                returned += owner is None
                continue
            self.blocks[reg.hash] = _Block(block_id, 1 if owner is not None else 0)
            self._hash_of[block_id] = reg.hash
            if owner is None:
                self._lru[reg.hash] = None
            else:
                owner.held_ids.append(block_id)
                moved += 1
        return moved, returned

    def release(self, state: PrefixState) -> int:
        """The request left: its references drop (deepest block first, so a prefix outlives its tails), its
        unsent claims go back. Returns its blocks still in transit (kept reserved until settled)."""
        for block_id in reversed(state.held_ids):
            h = self._hash_of.get(block_id)
            if h is None:
                continue
            block = self.blocks[h]
            block.refs -= 1
            if block.refs == 0:
                self._lru[h] = None
        state.held_ids = []
        for index in state.claimed:
            h = state.hashes[index]
            if self._claims.get(h) is state and index not in state.in_transit.values():
                del self._claims[h]
        for block_id in state.in_transit:
            self._registering[block_id].owner = None
        in_transit = len(state.in_transit)
        state.claimed, state.in_transit = set(), {}
        return in_transit

    def take_evictions(self) -> tuple[int, ...]:
        out, self.pending_evictions = tuple(self.pending_evictions), []
        return out
