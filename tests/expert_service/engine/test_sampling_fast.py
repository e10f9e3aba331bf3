"""The host sampler's filters and draw without sorting the vocabulary (sampling.filtered_weights, _draw_blocked)
against the plain definitions: filter_logits keeps exactly the same tokens with the same probabilities (random
rows with ties, suppressed tokens, every filter alone and combined, vocabularies across draw blocks), and the
block-by-block draw picks the token a cumulative sum over every token picks."""

import numpy as np
import pytest

from expert_service.engine import sampling
from expert_service.engine.sampling import Sampler, SamplingParams, filter_logits, filtered_weights


def _row(rng, V, spread):
    """float32 logits with ties (rounded to a grid) and a few suppressed (-inf) tokens, shifted to <= 0."""
    logits = np.round(rng.standard_normal(V) * spread, 1).astype(np.float32)
    logits[rng.choice(V, V // 50, replace=False)] = -np.inf
    logits[int(np.argmax(logits))] += 0  # the top token stays finite
    return logits - logits.max()


@pytest.mark.parametrize("V", [7, 300, 5000])
@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.3, 0.0), (0, 1.0, 0.05), (40, 0.95, 0.0), (40, 0.8, 0.02)],
)
def test_keeps_what_filter_logits_keeps_with_its_probabilities(V, top_k, top_p, min_p):
    rng = np.random.default_rng(V + top_k + int(top_p * 100) + int(min_p * 1000))
    for spread in (0.5, 3.0, 12.0):  # flat (the nucleus spans wide), moderate, peaked
        scaled = _row(rng, V, spread)
        reference = filter_logits(scaled.astype(np.float64), top_k, top_p, min_p)
        ids, weights = filtered_weights(scaled, top_k, top_p, min_p)
        dense = np.zeros(V)
        if ids is None:
            dense[:] = weights
        else:
            assert np.unique(ids).size == ids.size
            dense[ids] = weights
        kept = np.flatnonzero(dense > 0)
        np.testing.assert_array_equal(kept, np.flatnonzero(np.isfinite(reference) & (np.exp(reference) > 0)))
        expected = np.exp(reference[kept]) / np.exp(reference[kept]).sum()
        np.testing.assert_allclose(dense[kept] / dense[kept].sum(), expected, rtol=2e-6)


def test_the_nucleus_falls_back_to_the_whole_vocabulary():
    """Every token within a few nats of the top: no span holds top_p of the mass before the last one."""
    scaled = -np.linspace(0, 40, 2000).astype(np.float32)
    ids, _ = filtered_weights(scaled, 0, 0.999999, 0.0)
    reference = filter_logits(scaled.astype(np.float64), 0, 0.999999, 0.0)
    np.testing.assert_array_equal(np.sort(ids), np.flatnonzero(np.isfinite(reference)))


@pytest.mark.parametrize("V", [1, 1023, 1024, 1025, 5000])
def test_blocked_draw_picks_the_plain_cumulative_sums_token(V):
    """Integer weights (exact float sums) with zeros: for every u the token whose cumulative weight first exceeds
    u x the total, never a zero-weight one."""
    rng = np.random.default_rng(V)
    weights = rng.integers(0, 4, V).astype(np.float32)
    weights[rng.integers(V)] = 1.0
    cdf = np.cumsum(weights.astype(np.float64))
    for u in np.concatenate([rng.random(2000), [0.0, np.nextafter(1.0, 0.0)]]):
        token = sampling._draw_blocked(weights, float(u))
        assert token == min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), V - 1)
        assert weights[token] > 0


def test_plain_sampling_across_blocks_follows_the_distribution():
    V = 3 * sampling.DRAW_BLOCK + 17
    logits = np.full(V, -30.0, np.float32)
    heavy = np.array([5, sampling.DRAW_BLOCK + 3, 2 * sampling.DRAW_BLOCK + 900, V - 1])
    logits[heavy] = np.log([0.4, 0.3, 0.2, 0.1]).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=9))
    tokens = np.array([sampler.sample(logits) for _ in range(4000)])
    freq = np.array([(tokens == h).mean() for h in heavy])
    np.testing.assert_allclose(freq, [0.4, 0.3, 0.2, 0.1], atol=0.03)


def test_a_temperature_below_float32s_range_is_greedy():
    logits = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1e-300, seed=1))
    assert [sampler.sample(logits) for _ in range(5)] == [int(np.argmax(logits))] * 5


def test_a_seed_draws_the_tokens_the_full_sort_sampler_drew():
    """The kept tokens are drawn over in id order, as the previous sampler's cumulative sum over the whole row did,
    so a seed keeps its tokens (up to float rounding at a boundary): top-p included."""
    from bench.sampler_host import previous

    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(2000) * 2.5).astype(np.float32)
    logits[rng.choice(2000, 20, replace=False)] += 8.0
    for params in (
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.7, top_p=0.9, seed=4),
        SamplingParams(temperature=0.7, top_k=50, seed=5),
        SamplingParams(temperature=1.0, min_p=0.05, seed=6),
    ):
        sampler, before = Sampler(params), previous(params)
        now, then = [sampler.sample(logits) for _ in range(300)], [before(logits) for _ in range(300)]
        assert sum(a != b for a, b in zip(now, then)) <= 3, params


def test_a_temperature_above_float32s_range_draws_every_allowed_token():
    logits = np.arange(10, dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1e39, stop_token_ids=(9,), min_new_tokens=1000, seed=2))
    tokens = [sampler.sample(logits) for _ in range(400)]
    assert 9 not in tokens and set(tokens) == set(range(9))
