import pytest

from common.errors import CapacityError
from common.kv_blocks import blocks_needed
from expert_service.engine.kv_cache import BlockAllocator


def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_grow_free_and_accounting():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    assert alloc.ensure_capacity(1, 5) == [0, 1]
    assert alloc.ensure_capacity(1, 8) == [0, 1]  # still fits
    assert alloc.ensure_capacity(2, 9) == [2, 3, 4]
    assert alloc.num_free_blocks == 1
    assert alloc.free(1) == 2 and alloc.num_free_blocks == 3 and alloc.num_used_blocks == 3
    assert alloc.free(1) == 0 and alloc.ensure_capacity(3, 1) == [0]  # freed blocks are handed out again


def test_refuses_all_or_nothing():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    with pytest.raises(CapacityError, match="needs 3 more blocks"):
        alloc.ensure_capacity(7, 12)
    assert alloc.num_free_blocks == 2 and 7 not in alloc.tables


def test_cancel_storm_returns_every_block():
    rng = __import__("numpy").random.default_rng(0)
    alloc = BlockAllocator(num_blocks=64, block_size=2)
    refused = 0
    for _ in range(500):
        if rng.random() < 0.6:
            seq = int(rng.integers(0, 20))
            current = len(alloc.tables.get(seq, [])) * 2
            try:
                alloc.ensure_capacity(seq, current + int(rng.integers(1, 9)))
            except CapacityError:
                refused += 1
        elif alloc.tables:
            alloc.free(int(rng.choice(list(alloc.tables))))
        assert alloc.num_free_blocks + sum(map(len, alloc.tables.values())) == 64
    for seq in list(alloc.tables):
        alloc.free(seq)
    assert refused > 0 and alloc.num_free_blocks == 64 and not alloc.tables
