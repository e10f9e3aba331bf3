import numpy as np
import pytest

from expert_service.cpu.layers.moe import grouped_experts, route
from expert_service.experts.grouping import combine, group_by_expert, ungroup


def slow_reference(expert_ids, num_experts):
    """Per expert, the (token, slot) assignments in token order."""
    return {
        e: [(t, k) for t in range(expert_ids.shape[0]) for k in range(expert_ids.shape[1]) if expert_ids[t, k] == e]
        for e in range(num_experts)
    }


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 1, 1), (33, 2, 8), (17, 3, 60), (5, 4, 7)])
def test_groups_match_slow_reference(tokens, top_k, experts):
    rng = np.random.default_rng(tokens * 100 + experts)
    ids = np.stack([rng.choice(experts, size=top_k, replace=False) for _ in range(tokens)])
    groups = group_by_expert(ids, experts)
    ref = slow_reference(ids, experts)
    assert groups.offsets[0] == 0 and groups.offsets[-1] == tokens * top_k
    for e in range(experts):
        slots = groups.order[groups.offsets[e] : groups.offsets[e + 1]]
        assert [(s // top_k, s % top_k) for s in slots] == ref[e]
        assert groups.tokens_of(e).tolist() == [t for t, _ in ref[e]]
    assert sorted(groups.order.tolist()) == list(range(tokens * top_k))  # a permutation


def test_expert_with_no_tokens_and_all_tokens_on_one_expert():
    ids = np.full((9, 1), 3)
    groups = group_by_expert(ids, 5)
    assert groups.counts().tolist() == [0, 0, 0, 9, 0]
    assert groups.active_experts().tolist() == [3]
    assert groups.tokens_of(0).size == 0 and groups.tokens_of(3).tolist() == list(range(9))


def test_round_trip_and_combine():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(6, size=2, replace=False) for _ in range(11)])
    groups = group_by_expert(ids, 6)
    rows = rng.standard_normal((22, 5)).astype(np.float32)  # one row per assignment t*K+k
    assert np.array_equal(ungroup(rows[groups.order], groups), rows)
    weights = rng.random((11, 2)).astype(np.float32)
    expected = (rows.reshape(11, 2, 5) * weights[:, :, None]).sum(axis=1)
    np.testing.assert_allclose(combine(rows[groups.order], groups, weights), expected, rtol=1e-6)


def test_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        group_by_expert(np.array([[4]]), 4)


def test_grouped_experts_equals_per_token_loop():
    rng = np.random.default_rng(1)
    T, D, F, E, K = 13, 12, 7, 5, 2
    x = rng.standard_normal((T, D)).astype(np.float32)
    experts = [tuple(rng.standard_normal(s).astype(np.float32) for s in ((F, D), (F, D), (D, F))) for _ in range(E)]
    ids, weights = route(rng.standard_normal((T, E)).astype(np.float32), K, normalize=True)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    out = grouped_experts(x, group_by_expert(ids, E), weights, lambda e: experts[e])
    silu = lambda v: v / (1 + np.exp(-v))
    for t in range(T):
        ref = sum(
            w * (silu(x[t] @ g.T) * (x[t] @ u.T)) @ d.T
            for w, (g, u, d) in ((weights[t, k], experts[ids[t, k]]) for k in range(K))
        )
        np.testing.assert_allclose(out[t], ref, rtol=1e-5, atol=1e-5)
