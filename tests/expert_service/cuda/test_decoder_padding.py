"""How the cuda decoder pads non-decode steps to token buckets (pure functions of cuda/staging.py; no GPU)."""

import numpy as np
import pytest

from expert_service.cuda.staging import padding_seq_starts, prefill_buckets


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 64, 100, 512, 2048, 8192])
def test_buckets_cover_every_size_with_at_most_a_third_padding(max_tokens):
    buckets = prefill_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_tokens
    for T in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= T)
        assert bucket - T <= bucket / 3, (T, bucket)
    assert len(buckets) <= 2 * max_tokens.bit_length()  # graphs to capture stay few


@pytest.mark.parametrize("n, T, count", [(5, 8, 3), (0, 4, 4), (7, 7, 0), (61, 64, 3)])
def test_decode_padding_gives_each_padding_sequence_one_token(n, T, count):
    """A decode bucket: as many padding tokens as padding sequences, one each (attention_decode's layout)."""
    np.testing.assert_array_equal(padding_seq_starts(n, T, count, one_each=True), n + np.arange(1, count + 1))


@pytest.mark.parametrize(
    "n, T, count",
    [(5, 100, 3), (5, 6, 3), (5, 5, 2), (0, 48, 1), (33, 48, 15), (3, 4, 65), (512, 512, 65), (61, 64, 3)],
)
def test_token_padding_is_one_sequence_and_empty_slots(n, T, count):
    """A token bucket: the first padding sequence holds tokens n..T-1, every later slot is empty (ends at T), so
    the prefill attention sees one run of padding tiles, even when the counts happen to match a decode layout;
    ends never go backwards (the kernels walk seq_starts)."""
    ends = padding_seq_starts(n, T, count, one_each=False)
    starts = np.concatenate([[n], ends[:-1]])
    sizes = ends - starts
    assert len(ends) == count and (ends == T).all() and (sizes >= 0).all() and sizes.sum() == T - n
    assert (sizes[1:] == 0).all()
