"""expert_grouping kernel vs expert_service.experts.grouping.group_by_expert. Order within an expert comes from
atomics, so each expert's assignments are compared as sets, plus the exact inverse relation with position."""

import numpy as np
import pytest
from numba import cuda

from expert_service.experts.grouping import group_by_expert
from expert_service.kernels.expert_grouping import launch_expert_grouping
from tests.helpers import random_ids


def run_and_check(ids, n_exp):
    n = ids.size
    bufs = [cuda.to_device(np.full(size, -5, np.int32)) for size in (n_exp, n_exp + 1, n, n)]
    launch_expert_grouping(cuda.to_device(ids), *bufs)
    counts, offsets, order, position = (b.copy_to_host() for b in bufs)
    ref = group_by_expert(ids, n_exp)
    np.testing.assert_array_equal(offsets, ref.offsets)
    np.testing.assert_array_equal(counts, ref.counts())
    for e in range(n_exp):
        want = ref.order[ref.offsets[e] : ref.offsets[e + 1]]
        assert sorted(order[offsets[e] : offsets[e + 1]].tolist()) == want.tolist()
    np.testing.assert_array_equal(position[order], np.arange(n))  # inverse permutation, every slot written
    np.testing.assert_array_equal(order[position], np.arange(n))


@pytest.mark.parametrize("n_tok,top_k,n_exp", [(1, 1, 1), (33, 2, 8), (17, 3, 60), (5, 4, 7), (20, 4, 256)])
def test_matches_reference(n_tok, top_k, n_exp):
    rng = np.random.default_rng(n_tok * 100 + n_exp)
    run_and_check(random_ids(rng, n_tok, top_k, n_exp), n_exp)


def test_all_tokens_on_one_expert_and_empty_experts():
    run_and_check(np.full((40, 1), 3, np.int32), 7)


def test_counts_are_rezeroed_between_calls():
    ids = cuda.to_device(np.array([[0, 1], [1, 2]], np.int32))
    bufs = [cuda.to_device(np.zeros(s, np.int32)) for s in (3, 4, 4, 4)]
    launch_expert_grouping(ids, *bufs)
    launch_expert_grouping(ids, *bufs)
    assert bufs[0].copy_to_host().tolist() == [1, 2, 1]
    assert bufs[1].copy_to_host().tolist() == [0, 1, 3, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("n_exp,top_k", [(8, 2), (128, 8)])
@pytest.mark.parametrize("n_tok", [1, 16, 64, 512, 8192])
def test_gpu_realistic(n_tok, top_k, n_exp):
    rng = np.random.default_rng(n_tok)
    run_and_check(random_ids(rng, n_tok, top_k, n_exp), n_exp)
    run_and_check(np.full((n_tok, 1), n_exp - 1, np.int32), n_exp)
