"""How the cuda decoder pads non-decode steps to token buckets (pure functions of cuda/decoder.py; no GPU)."""
import numpy as np
import pytest

from expert_service.cuda.decoder import padding_seq_starts, prefill_buckets


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 64, 100, 512, 2048, 8192])
def test_buckets_cover_every_size_with_at_most_a_third_padding(max_tokens):
    buckets = prefill_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_tokens
    for T in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= T)
        assert bucket - T <= bucket / 3, (T, bucket)
    assert len(buckets) <= 2 * max_tokens.bit_length()        # graphs to capture stay few


@pytest.mark.parametrize("n, T, count", [(5, 8, 3), (5, 100, 3), (5, 6, 3), (5, 5, 2), (0, 4, 4), (0, 48, 1),
                                         (7, 7, 0), (3, 4, 1)])
def test_padding_sequences_own_exactly_the_padding_tokens(n, T, count):
    """Padding sequences follow the n real tokens: together they hold tokens n..T-1, each at most one except the
    last, and ends never go backwards (the attention kernels walk seq_starts)."""
    ends = padding_seq_starts(n, T, count)
    assert len(ends) == count
    if count:
        starts = np.concatenate([[n], ends[:-1]])
        sizes = ends - starts
        assert ends[-1] == T and (sizes >= 0).all() and sizes.sum() == T - n
        assert (sizes[:-1] <= 1).all()
    else:
        assert T == n
