"""Paged KV cache: one pool of fixed-size blocks shared by every sequence, allocated once at start-up.

A sequence owns a block table (pool block ids in position order); token at position p lives in block
``table[p // block_size]`` at row ``p % block_size``. Admission is by free blocks: the allocator refuses
(CapacityError) rather than growing, and freeing returns a sequence's blocks at once.

Prefix caching: the worker follows the router's instructions and keeps no policy of its own. A block a
sequence has filled can be *registered* under a key the router chose; a new sequence can *attach* registered
blocks as the start of its table (they are shared: reference-counted, never written, since a sequence only
writes past its cached length); a registered block stays in the pool after its sequences are freed until the
router *evicts* its key. Keys are (owner, id) pairs: each router stream names its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import CapacityError
from common.kv_blocks import blocks_needed


class BlockAllocator:
    """Free-list allocator of KV block ids with per-sequence block tables (pure Python, no arrays)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise CapacityError(f"KV cache: num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}
        self.cached: dict[tuple[int, int], int] = {}  # prefix-cache key -> block
        self._key_of: dict[int, tuple[int, int]] = {}  # block -> its key, while registered
        self._refs: dict[int, int] = {}  # block -> tables holding it, for blocks registered at some point
        self._num_idle = 0  # registered blocks no table holds: cached for reuse, not in use

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks sequences hold (cached blocks none holds are kept for reuse, not counted)."""
        return self.num_blocks - len(self._free) - self._num_idle

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grows `seq_id`'s table to hold `num_tokens` tokens; all-or-nothing."""
        table = self.tables.setdefault(seq_id, [])
        extra = blocks_needed(num_tokens, self.block_size) - len(table)
        if extra > len(self._free):
            if not table:
                del self.tables[seq_id]
            raise CapacityError(
                f"KV cache: sequence {seq_id} needs {extra} more blocks for {num_tokens} tokens, "
                f"{len(self._free)} of {self.num_blocks} free"
            )
        for _ in range(max(extra, 0)):
            table.append(self._free.pop())
        return table

    def free(self, seq_id: int) -> int:
        table = self.tables.pop(seq_id, [])
        for block in reversed(table):
            refs = self._refs.get(block)
            if refs is None:
                self._free.append(block)
                continue
            if refs > 1:
                self._refs[block] = refs - 1
                continue
            del self._refs[block]
            if block not in self._key_of:  # evicted while held: back to the pool with its last holder
                self._free.append(block)
            else:
                self._num_idle += 1
        return len(table)

    # --- prefix caching -------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def check_attach(self, keys: list[tuple[int, int]]) -> None:
        """Raises KeyError naming the first key not registered."""
        for key in keys:
            if key not in self.cached:
                raise KeyError(key)

    def attach(self, seq_id: int, keys: list[tuple[int, int]]) -> None:
        """Starts `seq_id`'s table with the registered blocks of `keys` (check_attach first)."""
        if self.tables.get(seq_id):
            raise ValueError(f"KV cache: sequence {seq_id} already holds blocks; a prefix starts a new one")
        table = [self.cached[key] for key in keys]
        for block in table:
            refs = self._refs.get(block, 0)
            self._num_idle -= refs == 0
            self._refs[block] = refs + 1
        self.tables[seq_id] = table

    def can_register(self, seq_id: int, index: int, key: tuple[int, int]) -> bool:
        """Whether `register` would succeed: the key is free or already this block's, and the block has no
        other key. A block the step being launched allocates (past the table) has no key yet."""
        table = self.tables.get(seq_id, [])
        if index >= len(table):
            return key not in self.cached
        block = table[index]
        return self.cached.get(key, block) == block and self._key_of.get(block, key) == key

    def register(self, seq_id: int, index: int, key: tuple[int, int]) -> bool:
        """Registers block `index` of `seq_id`'s table under `key`; False (nothing done) when the key is taken
        by another block or the block is registered under another key. Registering it again is a no-op."""
        if not self.can_register(seq_id, index, key):
            return False
        block = self.tables[seq_id][index]
        self.cached[key] = block
        self._key_of[block] = key
        self._refs.setdefault(block, 1)
        return True

    def evict(self, key: tuple[int, int]) -> bool:
        """Drops a registered key; its block returns to the pool now, or when its last holder is freed.
        False when the key is not registered."""
        block = self.cached.pop(key, None)
        if block is None:
            return False
        del self._key_of[block]
        if block not in self._refs:
            self._free.append(block)
            self._num_idle -= 1
        return True

    def evict_owner(self, owner: int) -> int:
        """Drops every key of one owner (its stream ended); returns how many."""
        keys = [key for key in self.cached if key[0] == owner]
        for key in keys:
            self.evict(key)
        return len(keys)


@dataclass
class KVPool:
    """K and V storage: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each."""

    k: np.ndarray
    v: np.ndarray

    @classmethod
    def allocate(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=np.float32
    ) -> KVPool:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(np.zeros(shape, dtype), np.zeros(shape, dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
