"""Automatic prefix caching, the router's half: which full KV blocks are cached, under which ids, and which to
evict. Pure Python; the scheduler calls it and the worker's pool follows what the steps carry.

Design note. A block is named by a chained hash: sha256(parent's hash, its tokens), the root being a hash of
the model's identity and the request's cache salt, so equal hashes mean equal KV and different salts never
share. The router is the only authority: it gives each cached block a stream-local id (the worker never sees a
hash), tells the worker in a prompt chunk to register the blocks that chunk completes under new ids, names the
ids a new sequence starts on, and names the ids to evict. A new stream (worker restart, reconnect) starts with
an empty index on both sides.

Blocks are shared as soon as they are written. The worker runs a stream's steps in order and registers a
chunk's blocks when it launches the step that writes them, so a block enters the index when the step that
computes it is scheduled, and any *later* step may start a sequence on it (a block is "ready" from the step
after its own). Its registering step's answer settles it: when that sequence failed on the worker (or the step was
refused) the block leaves the index at once (no new hits) but stays counted, detached, until the requests already on
it leave; then its id is evicted and its room returns. A request the router ends itself (a cancel, its deadline)
keeps its blocks in flight: the worker writes them before the step carrying its free. The worker therefore never
holds a cached block the router does not know of, and a sequence the router starts on a block is refused
(UNKNOWN_PREFIX_BLOCK) only when a step refused as a whole kept the block from being registered: that step was to
register it or, at pipeline depth 3 or more, a step sent behind it was, and the worker failed that chunk's sequence
alone or skipped a decoded block the refusal left short. A refusal that no detached block explains takes the
blocks the sequence started on out of the index (`forget`): blocks the worker lost otherwise (it keeps a live
stream's blocks through another caller's ClearCache, so this is a guard) are then computed again, not offered to
every later request.

Generated tokens too (a worker that says so: InfoResponse.caches_generated_blocks). Once a running request's
block is full of known tokens (prompt tail and generated ones) and the decode feeding its last position is in the
step being scheduled or an earlier one, that step tells the worker to register that block of the sequence under a
new id (cache_sequence_blocks; the worker does once the step is launched), so a chat's next turn, which resends
the answer, starts on it. Its hash chains on from the prompt's blocks. The last generated token is never fed, so
a request's last block is cached only when a token past it was fed.

Accounting. The scheduler's free blocks exclude blocks requests reserve and blocks the index holds (detached
ones included). A request reserves its prompt + max_new_tokens minus the blocks it starts on; a block it
registers moves from its reservation into the index when its chunk (or the step carrying its registration) is
scheduled (net zero). Index blocks no request holds are kept in LRU order and evicted only when an admission
needs their room. Only full blocks are cached, and a hit is capped one token short of the prompt, so the
prompt's last token is always computed (its logits sample the first new token) and a shared block is never
written.

Requests racing for one prefix: a request whose next uncached block is claimed by a running request, or was
scheduled in the step being built, waits for it instead of computing it again, so n samples of one prompt, or
clients sharing a system prompt, prefill it once; they start on it in the step after the one that writes it.

Hashing runs on the router's event loop for every request (~0.12 ms for a 2,112-token prompt), so the cache
remembers the last prompts it hashed (_RecentPrompts) and a prompt that starts like one of them hashes only the
blocks past the whole blocks they share: a shared system prompt is hashed once, not once per client.
"""

from __future__ import annotations

import array
import collections
import hashlib
import itertools
import sys
from dataclasses import dataclass, field

# _RecentPrompts' bounds: the prompts it keeps, and the bytes they hold (4 a token, ~80 a block's hash and its object).
RECENT_PROMPTS = 64
RECENT_PROMPT_BYTES = 16 << 20
_HASH_BYTES = 80
# The worker's error for a sequence whose first chunk names a cached block it does not hold.
UNKNOWN_PREFIX_BLOCK = "UNKNOWN_PREFIX_BLOCK"


@dataclass
class PrefixState:
    """One request's part in the cache (ScheduledRequest.prefix)."""

    hashes: list[bytes]  # its prompt's full blocks, chained
    may_hit: bool  # looks the cache up (False with prompt_logprobs: every prompt position must be scored)
    # computes blocks for others to wait on (False with prompt_logprobs: its prompt runs a few rows a step)
    may_claim: bool = True
    hit_ids: list[int] = field(default_factory=list)  # the cached blocks it starts on
    held_ids: list[int] = field(default_factory=list)  # cached blocks it holds a reference on
    claimed: set[int] = field(default_factory=set)  # block indices it will compute for the cache


@dataclass(frozen=True, slots=True)
class _HashedPrompt:
    data: bytes  # its token ids as uint32 little-endian
    hashes: tuple[bytes, ...]  # the chained hashes of its full blocks

    @property
    def num_bytes(self) -> int:
        return len(self.data) + _HASH_BYTES * len(self.hashes)


class _RecentPrompts:
    """The prompts hashed last, by (salt, first block), least recently used first, bounded in prompts and bytes.

    A block's chained hash depends only on the namespace (one per PrefixCache), the salt and the bytes up to the
    block's end, so the hashes of the whole blocks a new prompt shares with a remembered one of the same salt are
    exactly its own: reused, they are the hashes computed from scratch. Keyed by the salt, a prompt never reuses
    another salt's hashes. It lives in its PrefixCache, so a new index (a worker reconnect) starts without it.
    """

    def __init__(self, max_prompts: int = RECENT_PROMPTS, max_bytes: int = RECENT_PROMPT_BYTES):
        self.max_prompts, self.max_bytes = max_prompts, max_bytes
        self.num_bytes = 0
        self._prompts: collections.OrderedDict[tuple[str, bytes], _HashedPrompt] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._prompts)

    def shared_hashes(self, salt: str, data: bytes, width: int) -> tuple[bytes, ...]:
        """The hashes of the whole blocks `data` shares from its start with the remembered prompt that begins
        with the same block under the same salt; empty when none does."""
        seen = self._prompts.get((salt, data[:width]))
        return seen.hashes[: _shared_blocks(seen.data, data, width)] if seen is not None else ()

    def remember(self, salt: str, data: bytes, hashes: tuple[bytes, ...], width: int) -> None:
        """Keeps `data` (at least one full block) as the latest prompt beginning with its first block, then
        forgets the least recently hashed prompts beyond the bounds (the latest one always stays)."""
        key, entry = (salt, data[:width]), _HashedPrompt(data, hashes)
        old = self._prompts.pop(key, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        self._prompts[key] = entry
        self.num_bytes += entry.num_bytes
        while len(self._prompts) > 1 and (len(self._prompts) > self.max_prompts or self.num_bytes > self.max_bytes):
            self.num_bytes -= self._prompts.popitem(last=False)[1].num_bytes


def _token_bytes(token_ids: list[int]) -> bytes:
    """Token ids (< 2**32) as uint32 little-endian, the bytes a block's hash covers."""
    words = array.array("I", token_ids)  # twice as fast as numpy from a list; "I" is 4 bytes where we run
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes()


def _shared_blocks(old: bytes, new: bytes, width: int) -> int:
    """How many whole blocks of `width` bytes `new` shares with `old` from the start. A binary search over
    prefix comparisons (memcmp on a view of `new`, no copies): most prompts share all but their last blocks."""
    view = memoryview(new)
    lo, hi = 0, min(len(old), len(new)) // width
    if old.startswith(view[: hi * width]):
        return hi
    while hi - lo > 1:  # the first lo blocks are shared, the first hi are not
        mid = (lo + hi) // 2
        if old.startswith(view[: mid * width]):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True)
class _Block:
    block_id: int
    hash: bytes
    refs: int
    ready_step: int  # the first step that may start a sequence on it (the one after the step writing it)


class PrefixCache:
    def __init__(self, block_size: int, namespace: bytes, caches_generated: bool = False):
        self.block_size = block_size
        self._identity = namespace
        self.namespace = hashlib.sha256(b"colibri-prefix-v1\0" + namespace).digest()
        # the worker registers full blocks a running sequence's decodes wrote (InfoResponse.caches_generated_blocks)
        self.caches_generated = caches_generated
        self.blocks: dict[bytes, _Block] = {}  # the index: hash -> block
        self._by_id: dict[int, _Block] = {}  # every block the router counts: the index and detached ones
        self._unsettled: set[int] = set()  # ids whose registering step has not come back
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # unreferenced, oldest first
        self._claims: dict[bytes, PrefixState] = {}  # hash -> the request that will compute it
        self._ids = itertools.count(1)
        self._step = 0  # the step being scheduled (begin_step)
        self._recent = _RecentPrompts()  # the prompts hashed last, whose hashes a prompt starting alike reuses
        self.pending_evictions: list[int] = []  # ids the next step tells the worker to drop
        # Counters for metrics, in tokens and blocks: queries at admission, hits once the worker ran on them.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted = 0
        self._reported = (0, 0, 0)  # the counters as unreported_counts last returned them

    # ---- hashing ----
    def hashes(self, token_ids: list[int], salt: str = "", token_bytes: bytes = b"") -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids` (ids < 2**32, as uint32 little-endian; those bytes
        when the caller has them in `token_bytes`). The whole blocks it shares with a recent prompt of the same
        salt reuse that prompt's hashes."""
        data, width, sha256 = token_bytes or _token_bytes(token_ids), 4 * self.block_size, hashlib.sha256
        if len(data) < width:
            return []
        out = list(self._recent.shared_hashes(salt, data, width))
        parent = out[-1] if out else self._root(salt)
        for start in range(len(out) * width, len(data) - width + 1, width):
            parent = sha256(parent + data[start : start + width]).digest()
            out.append(parent)
        self._recent.remember(salt, data, tuple(out), width)
        return out

    def cleared(self) -> PrefixCache:
        """An empty index for the same model and worker (a lost worker's blocks are gone)."""
        return PrefixCache(self.block_size, self._identity, self.caches_generated)

    def _root(self, salt: str) -> bytes:
        """The parent of a prompt's first block: the model's identity, and the salt when there is one."""
        return hashlib.sha256(self.namespace + b"salt\0" + salt.encode()).digest() if salt else self.namespace

    def unreported_counts(self) -> tuple[int, int, int]:
        """(query tokens, hit tokens, evicted blocks) counted since the last call. Kept by the index itself: a
        new index (a reconnect) starts from zero, whatever an earlier one reported."""
        counts = (self.num_query_tokens, self.num_hit_tokens, self.num_evicted)
        delta = (counts[0] - self._reported[0], counts[1] - self._reported[1], counts[2] - self._reported[2])
        self._reported = counts
        return delta

    # ---- what the scheduler reads ----
    @property
    def num_cached_blocks(self) -> int:
        """Blocks the index and detached blocks hold: room no request reserves and the free pool lacks."""
        return len(self._by_id)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._lru)

    def begin_step(self) -> None:
        """A new step is being scheduled: blocks the previous steps write are ready for it."""
        self._step += 1

    def lookup(self, state: PrefixState, num_prompt_tokens: int) -> int | None:
        """How many leading blocks the request would start on, or None when it should wait: its next block
        is claimed by a running request or written by the step being built."""
        if not state.may_hit:
            return 0
        usable = state.hashes[: (num_prompt_tokens - 1) // self.block_size]
        k = 0
        while k < len(usable):
            block = self.blocks.get(usable[k])
            if block is None:
                break
            if block.ready_step > self._step:
                return None
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
            self._drop(self.blocks.pop(h))
            self.num_evicted += 1
        if state.may_hit:  # its hits count once the worker ran its first chunk on them (`reused`)
            self.num_query_tokens += num_prompt_tokens
        for index in range(k, len(state.hashes) if state.may_claim else k):
            h = state.hashes[index]
            if h not in self.blocks and h not in self._claims:
                self._claims[h] = state
                state.claimed.add(index)

    def reused(self, num_blocks: int) -> None:
        """A sequence's first chunk ran on `num_blocks` cached blocks: the hits it looked up are real (one refused
        on them, UNKNOWN_PREFIX_BLOCK or its step refused as a whole, reused nothing)."""
        self.num_hit_tokens += num_blocks * self.block_size

    def evict_ahead(self, state: PrefixState, k: int, count: int) -> int:
        """Evicts up to `count` LRU blocks, the request's first `k` (its hits) kept: an admission whose evictions'
        ids cannot ride one step makes its room over several. Returns how many were evicted."""
        own = set(state.hashes[:k])
        victims = list(itertools.islice((h for h in self._lru if h not in own), count))
        for h in victims:
            del self._lru[h]
            self._drop(self.blocks.pop(h))
        self.num_evicted += len(victims)
        return len(victims)

    def chunk_block_ids(self, state: PrefixState, start: int, num_tokens: int) -> tuple[int, ...]:
        """One id per block the chunk [start, start + num_tokens) completes: a new id for a block the request
        claimed (in the index from now on, held by the request, ready from the next step), 0 for one it does
        not cache."""
        bs = self.block_size
        ids = []
        for index in range(start // bs, (start + num_tokens) // bs):
            h = state.hashes[index] if index in state.claimed else None
            if h is None or self._claims.get(h) is not state:
                ids.append(0)
                continue
            state.claimed.discard(index)
            del self._claims[h]
            ids.append(self._register(state, h))
        return tuple(ids)

    def cache_generated(self, state: PrefixState, salt: str, tokens: list[int]) -> int:
        """The next full block of a running request (its `tokens`: prompt tail and generated ones, in order), whose
        last position the step being scheduled or an earlier one feeds: its chained hash extends state.hashes, and
        it gets a new id (held by the request, ready from the next step, settled by the step carrying it) unless an
        equal block is cached or claimed (0)."""
        parent = state.hashes[-1] if state.hashes else self._root(salt)
        h = hashlib.sha256(parent + _token_bytes(tokens)).digest()
        state.hashes.append(h)
        if h in self.blocks or h in self._claims:
            return 0
        return self._register(state, h)

    def _register(self, state: PrefixState, h: bytes) -> int:
        """A new block the request computes: in the index under a new id, held by it, ready from the next step,
        unsettled until the step writing it comes back."""
        block = _Block(next(self._ids), h, 1, self._step + 1)
        self.blocks[h] = self._by_id[block.block_id] = block
        self._unsettled.add(block.block_id)
        state.held_ids.append(block.block_id)
        return block.block_id

    def settle(self, block_ids, ok: bool) -> int:
        """The step registering these blocks came back; ok: their sequence ran. A failed registration leaves
        the index (its KV is missing or suspect) and is evicted once no request holds it. Returns the blocks
        to give back to the free pool now."""
        returned = 0
        for block_id in block_ids:
            if block_id not in self._unsettled:
                continue
            self._unsettled.discard(block_id)
            block = self._by_id.get(block_id)
            if ok or block is None:  # fine, or evicted meanwhile (an unreferenced block, then id unused)
                continue
            self._detach(block)
            if block.refs == 0:
                self._drop(block)
                returned += 1
        return returned

    def failed(self, state: PrefixState) -> None:
        """Its sequence failed on the worker (an error for it, or its step refused), so the blocks it registers in
        steps still in flight will not be written: they leave the index now, and are evicted once no request
        holds them. Not for a request the router ends itself: the worker runs what it was sent before the free."""
        hits = set(state.hit_ids)
        for block_id in state.held_ids:
            block = self._by_id.get(block_id)
            if block is not None and block_id in self._unsettled and block_id not in hits:  # its own, not written
                self._detach(block)

    def release(self, state: PrefixState) -> int:
        """The request left: its references drop (deepest block first, so a prefix outlives its tails), its
        claims go back. Returns the blocks to give back to the free pool now (detached ones it held last)."""
        returned = 0
        for block_id in reversed(state.held_ids):
            block = self._by_id.get(block_id)
            if block is None:
                continue
            block.refs -= 1
            if block.refs:
                continue
            if self.blocks.get(block.hash) is block:
                self._lru[block.hash] = None
            else:  # detached: a failed registration whose last holder left
                self._drop(block)
                returned += 1
        state.held_ids = []
        for index in state.claimed:
            h = state.hashes[index]
            if self._claims.get(h) is state:
                del self._claims[h]
        state.claimed = set()
        return returned

    def forget(self, block_ids) -> int:
        """A sequence started on these blocks was refused UNKNOWN_PREFIX_BLOCK: the worker lacks one of them. When
        one already left the index (a refused step was to register it: detached when that answer came), that is
        the one, and the others stay. Otherwise the worker lost blocks the router still offers (a guard: the worker
        keeps a live stream's blocks): they all leave the index, so the next request computes them again, and are evicted once no
        request holds them. Returns the blocks to give back to the free pool now (those none holds)."""
        blocks = [self._by_id.get(block_id) for block_id in block_ids]
        indexed = [block for block in blocks if block is not None and self.blocks.get(block.hash) is block]
        if len(indexed) < len(blocks):
            return 0
        for block in indexed:
            self._detach(block)
            if not block.refs:
                self._drop(block)
        return sum(not block.refs for block in indexed)

    def take_evictions(self, limit: int | None = None) -> tuple[int, ...]:
        """The evictions the next step carries: all, or the first `limit` (the rest wait for a later step)."""
        limit = len(self.pending_evictions) if limit is None else limit
        out, self.pending_evictions = tuple(self.pending_evictions[:limit]), self.pending_evictions[limit:]
        return out

    def _detach(self, block: _Block) -> None:
        """Takes a block out of the index (no new hits); it stays counted until no request holds it."""
        if self.blocks.get(block.hash) is block:
            del self.blocks[block.hash]
            self._lru.pop(block.hash, None)

    def _drop(self, block: _Block) -> None:
        """Forgets a block no request holds; the next step evicts its id on the worker."""
        del self._by_id[block.block_id]
        self.pending_evictions.append(block.block_id)
