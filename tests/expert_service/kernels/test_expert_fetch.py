"""expert_fetch vs numpy: every listed expert block lands whole in its slot, every other slot keeps its bytes,
from random data (never zeros), for lists that fill the grid unevenly and an empty one."""

import time

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


@pytest.mark.parametrize("speculative", [False, True])
def test_demand_and_speculative_copies_equal_plain_ones_and_leave_the_count_at_zero(speculative):
    """Both roles copy what the plain kernel copies; a demand launch removes the CTAs it counted (the count ends at
    0, with and without work), and a speculative one never touches it."""
    rng = np.random.default_rng(7 + speculative)
    E, S, block_bytes = 5, 3, 4096
    words = block_bytes // 4
    src = rng.integers(1, 2**32, size=E * words, dtype=np.uint32)
    dst0 = rng.integers(1, 2**32, size=S * words, dtype=np.uint32)
    pairs = [(4, 2), (1, 0)]
    active = cuda.to_device(np.zeros(1, np.int32))
    for count in (len(pairs), 0):
        dst = cuda.to_device(dst0)
        launch_expert_fetch(
            src,
            dst,
            cuda.to_device(np.array([p[0] for p in pairs] + [9], np.int32)),
            cuda.to_device(np.array([p[1] for p in pairs] + [9], np.int32)),
            cuda.to_device(np.array([count], np.int32)),
            block_bytes,
            active=active,
            speculative=speculative,
        )
        want = dst0.copy().reshape(S, words)
        for e, s in pairs[:count]:
            want[s] = src.reshape(E, words)[e]
        np.testing.assert_array_equal(dst.copy_to_host().reshape(S, words), want)
        assert active.copy_to_host()[0] == 0
    with pytest.raises(ValueError, match="active must be int32"):
        launch_expert_fetch(
            src,
            dst,
            cuda.to_device(np.zeros(3, np.int32)),
            cuda.to_device(np.zeros(3, np.int32)),
            cuda.to_device(np.zeros(1, np.int32)),
            block_bytes,
            active=cuda.to_device(np.zeros(2, np.int32)),
        )


@pytest.mark.gpu
def test_a_speculative_copy_waits_while_a_demand_copy_is_counted():
    """A prefetch launched while the demand count is 1 copies nothing until the count drops (set from another
    stream), then copies its blocks whole."""
    rng = np.random.default_rng(11)
    E, S, block_bytes = 4, 2, 1 << 20
    words = block_bytes // 4
    src_host = rng.integers(1, 2**32, size=E * words, dtype=np.uint32)
    src = cuda.to_device(src_host)  # a host array would be copied back after the launch, behind the waiting kernel
    dst = cuda.to_device(np.zeros(S * words, np.uint32) + 1)
    active = cuda.to_device(np.ones(1, np.int32))
    waiting, releasing = cuda.stream(), cuda.stream()
    launch_expert_fetch(
        src,
        dst,
        cuda.to_device(np.array([3, 0], np.int32)),
        cuda.to_device(np.array([0, 1], np.int32)),
        cuda.to_device(np.array([2], np.int32)),
        block_bytes,
        stream=waiting,
        active=active,
        speculative=True,
    )
    time.sleep(0.2)  # the kernel has long had time to copy 2 MiB, were it not waiting
    # a copy through another stream observes the destination while the kernel waits (nothing written yet)
    seen = cuda.pinned_array(16, np.uint32)
    dst[:16].copy_to_host(seen, stream=releasing)
    releasing.synchronize()
    assert (seen == 1).all()
    zero = cuda.pinned_array(1, np.int32)
    zero[0] = 0
    active.copy_to_device(zero, stream=releasing)
    waiting.synchronize()
    want = src_host.reshape(E, words)[[3, 0]].reshape(-1)
    np.testing.assert_array_equal(dst.copy_to_host(), want)
