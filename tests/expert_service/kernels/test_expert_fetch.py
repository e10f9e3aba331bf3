"""expert_fetch vs numpy: every listed expert block lands whole in its slot, every other slot keeps its bytes,
from random data (never zeros), for lists that fill the grid unevenly and an empty one."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.expert_fetch import launch_expert_fetch


@pytest.mark.parametrize(
    "E,S,block_bytes,pairs",
    [(4, 2, 64, [(3, 1)]), (6, 3, 208, [(5, 0), (0, 2), (2, 1)]), (3, 2, 16, [(1, 1), (2, 0)]), (5, 2, 4096, [(4, 0)])],
)
def test_copies_listed_blocks_only(E, S, block_bytes, pairs):
    rng = np.random.default_rng(block_bytes + E)
    words = block_bytes // 4
    src = rng.integers(1, 2**32, size=E * words, dtype=np.uint32)
    dst0 = rng.integers(1, 2**32, size=S * words, dtype=np.uint32)
    dst = cuda.to_device(dst0)
    cap = S + 1  # the list is longer than its count: entries past count are garbage
    expert = np.full(cap, 99, np.int32)
    slot = np.full(cap, 99, np.int32)
    expert[: len(pairs)], slot[: len(pairs)] = zip(*pairs) if pairs else ((), ())
    launch_expert_fetch(
        src,
        dst,
        cuda.to_device(expert[:S]),
        cuda.to_device(slot[:S]),
        cuda.to_device(np.array([len(pairs)], np.int32)),
        block_bytes,
    )
    want = dst0.copy().reshape(S, words)
    for e, s in pairs:
        want[s] = src.reshape(E, words)[e]
    np.testing.assert_array_equal(dst.copy_to_host().reshape(S, words), want)


def test_empty_list_writes_nothing_and_bad_shapes_are_refused():
    dst0 = np.arange(1, 33, dtype=np.uint32)
    dst = cuda.to_device(dst0)
    ids = cuda.to_device(np.zeros(2, np.int32))
    launch_expert_fetch(np.ones(32, np.uint32), dst, ids, ids, cuda.to_device(np.zeros(1, np.int32)), 64)
    np.testing.assert_array_equal(dst.copy_to_host(), dst0)
    with pytest.raises(ValueError, match="multiple of 16"):
        launch_expert_fetch(np.ones(32, np.uint32), dst, ids, ids, cuda.to_device(np.zeros(1, np.int32)), 40)
    with pytest.raises(ValueError, match="whole blocks"):
        launch_expert_fetch(np.ones(30, np.uint32), dst, ids, ids, cuda.to_device(np.zeros(1, np.int32)), 64)
