"""Two-pass greedy argmax vs numpy and vs the one-block greedy kernel (same ids and flags), with ties,
NaN / inf rows and a vocabulary that is not a multiple of the slice size."""

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels.greedy import launch_greedy
from expert_service.kernels.greedy_split import CHUNK, launch_greedy_split, parts
from tests.helpers import has_gpu


def run_split(logits):
    rows, vocab = logits.shape
    p = parts(vocab)
    ids, flags = (cuda.to_device(np.full(rows, -7, np.int32)) for _ in range(2))
    scratch = (
        cuda.to_device(np.full((rows, p), np.nan, np.float32)),
        cuda.to_device(np.full((rows, p), -7, np.int32)),
        cuda.to_device(np.full((rows, p), -7, np.int32)),
    )
    launch_greedy_split(cuda.to_device(logits), ids, flags, *scratch)
    return ids.copy_to_host(), flags.copy_to_host()


def run_one_block(logits):
    rows = logits.shape[0]
    ids, flags = (cuda.to_device(np.full(rows, -7, np.int32)) for _ in range(2))
    launch_greedy(cuda.to_device(logits), ids, flags, threads=32 if not has_gpu() else 256)
    return ids.copy_to_host(), flags.copy_to_host()


def check(rng, rows, vocab):
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    logits[0, rng.integers(vocab, size=3)] = np.float32(7.5)  # tie: lowest index wins
    if rows > 1:
        logits[1, vocab - 1] = np.inf
    if rows > 2:
        logits[2, 0] = np.nan
    if rows > 3:
        logits[3, :] = -np.inf
    if rows > 4:
        logits[4, rng.integers(vocab, size=5)] = np.nan
    ids, flags = run_split(logits)
    want_flags = (~np.isfinite(logits)).any(axis=1).astype(np.int32)
    want_ids = np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=1).astype(np.int32)
    np.testing.assert_array_equal(flags, want_flags)
    np.testing.assert_array_equal(ids, want_ids)
    one_ids, one_flags = run_one_block(logits)
    np.testing.assert_array_equal(ids, one_ids)
    np.testing.assert_array_equal(flags, one_flags)


@pytest.mark.parametrize("rows,vocab", [(1, 37), (5, 200), (2, 64)])
def test_matches_reference(rows, vocab):
    check(np.random.default_rng(vocab), rows, vocab)


def test_rejects_small_scratch():
    vocab = 3 * CHUNK  # 3 slices; scratch for 2
    with pytest.raises(ValueError):
        launch_greedy_split(
            cuda.to_device(np.zeros((2, vocab), np.float32)),
            *(cuda.to_device(np.zeros(2, np.int32)) for _ in range(2)),
            *(cuda.to_device(np.zeros((2, 2), dt)) for dt in (np.float32, np.int32, np.int32)),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu(rows):
    rng = np.random.default_rng(rows)
    for vocab in (32000, 151936, 1001):
        check(rng, rows, vocab)
