"""Paged KV cache: one pool of fixed-size blocks shared by every sequence, allocated once at start-up.

A sequence owns a block table (pool block ids in position order); token at position p lives in block
``table[p // block_size]`` at row ``p % block_size``. Admission is by free blocks: the allocator refuses
(CapacityError) rather than growing, and freeing returns a sequence's blocks at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import CapacityError


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free-list allocator of KV block ids with per-sequence block tables (pure Python, no arrays)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise CapacityError(f"KV cache: num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

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
        self._free.extend(reversed(table))
        return len(table)


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
