"""penalty_update vs the numpy reference (expert_service.engine.penalties.update_state), in the simulator and on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from expert_service.engine.penalties import SATURATED, PenaltyBatch, update_state
from expert_service.kernels.penalty_update import launch_penalty_update


def _batch(slots, tokens, output, resets=()) -> PenaltyBatch:
    """A batch of resets and updates only (no sampling rows)."""
    none_i, none_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return PenaltyBatch(
        np.asarray(resets, np.int32),
        np.asarray(slots, np.int32),
        np.asarray(tokens, np.int32),
        np.asarray(output, np.int32),
        none_i,
        none_f,
        none_f,
        none_f,
    )


def _updates(rng, slots: int, vocab: int, prompt_tokens: int):
    """Prompt marks of slot 0 (with repeats) and one output count for every other slot, some at saturation."""
    prompt = rng.integers(0, vocab, prompt_tokens)
    prompt[: prompt_tokens // 3] = prompt[0]  # the same token marked many times
    out_slots = np.arange(1, slots)
    out_tokens = rng.integers(0, vocab, slots - 1)
    slot_ids = np.concatenate([np.zeros(prompt_tokens, np.int64), out_slots]).astype(np.int32)
    tokens = np.concatenate([prompt, out_tokens]).astype(np.int32)
    output = np.concatenate([np.zeros(prompt_tokens), np.ones(slots - 1)]).astype(np.int32)
    return slot_ids, tokens, output


def _check(rng, slots: int, vocab: int, prompt_tokens: int):
    words = rng.integers(0, 1 << 16, (slots, vocab)).astype(np.uint16)
    slot_ids, tokens, output = _updates(rng, slots, vocab, prompt_tokens)
    words[slot_ids[-1], tokens[-1]] = SATURATED + 1  # a saturated count stays
    if slots > 2:
        words[slot_ids[-2], tokens[-2]] = SATURATED - 1  # the last count that still goes up
    batch = _batch(slot_ids, tokens, output)
    want = words.copy()
    update_state(want, batch)
    d_words = cuda.to_device(words)
    launch_penalty_update(d_words, cuda.to_device(slot_ids), cuda.to_device(tokens), cuda.to_device(output))
    got = d_words.copy_to_host()
    np.testing.assert_array_equal(got, want)
    assert (got != words).any()  # the updates changed something


@pytest.mark.parametrize("slots,vocab,prompt_tokens", [(3, 37, 9), (5, 130, 40)])
def test_penalty_update_matches_numpy(slots, vocab, prompt_tokens):
    _check(np.random.default_rng(slots * 100 + vocab), slots, vocab, prompt_tokens)


def test_penalty_update_reference_semantics():
    """The reference itself: bit 0 marks the prompt, each output adds 2, saturating below 0xFFFF."""
    words = np.zeros((2, 6), np.uint16)
    words[1, 4] = SATURATED
    update_state(words, _batch([0, 0, 0, 1, 1], [2, 2, 5, 3, 4], [0, 0, 0, 1, 1]))
    update_state(words, _batch([1], [3], [1]))
    np.testing.assert_array_equal(words, [[0, 0, 1, 0, 0, 1], [0, 0, 0, 4, SATURATED, 0]])
    update_state(words, _batch([], [], [], resets=[0]))
    assert not words[0].any() and words[1, 3] == 4  # a reset clears its slot alone


@pytest.mark.gpu
def test_penalty_update_gpu_large():
    _check(np.random.default_rng(7), 64, 151936, 8000)
