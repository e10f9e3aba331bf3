"""What a step refused as a whole does to the step the router pipelined behind it, built before the refusal was
known. The router fails the refused step's requests when its answer comes, but the step behind already carries
their next prompt chunks; those should fail alone (the router has dropped them), not refuse the step with every
other request in it. Strict xfails: known defects, described in docs/architecture.md's pipelining notes."""

from __future__ import annotations

import numpy as np
import pytest

from expert_service.engine.engine import UNKNOWN_SEQUENCE, PrefillInput
from tests.expert_service.serving.test_step_pump_differential import GREEDY, _engine, _one_at_a_time, _step


def _ids(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n)


@pytest.mark.xfail(strict=True, reason="a later chunk of a sequence the refused step was to start refuses its step")
def test_the_next_chunk_of_a_sequence_a_refused_step_started_fails_alone(tiny_model):
    engine = _engine(tiny_model, False, 256)
    vocab = engine.model_config.vocab_size
    steps = [
        # 1's first chunk, refused with the step (2's token is outside the vocabulary)
        _step(
            1, chunks=[PrefillInput(1, _ids(10, 8), GREEDY, False), PrefillInput(2, np.array([vocab]), GREEDY, True)]
        ),
        # sent before that answer: 1's next chunk, and 3, which has nothing to do with it
        _step(2, chunks=[PrefillInput(1, _ids(18, 4), None, True), PrefillInput(3, _ids(30, 5), GREEDY, True)]),
    ]
    answers, _ = _one_at_a_time(engine, steps)
    assert answers[0][0] == "refused"
    assert answers[1][0] != "refused", answers[1]
    errors = {rid: error for rid, _, error, *_ in answers[1]}
    assert errors == {1: UNKNOWN_SEQUENCE, 3: ""}


@pytest.mark.xfail(strict=True, reason="a chunk after a refused one names cache ids for blocks the worker lacks")
def test_a_chunk_after_a_refused_one_of_a_cached_prompt_fails_alone(tiny_model):
    """With prefix caching: 1's chunk in step 2 is refused, so the worker's sequence stays 4 tokens long while
    step 3's chunk names ids for the blocks tokens 10-15 complete (2); the worker counts 1 and refuses step 3."""
    engine = _engine(tiny_model, False, 256)
    vocab = engine.model_config.vocab_size
    steps = [
        _step(1, chunks=[PrefillInput(1, _ids(10, 4), GREEDY, False, cache_block_ids=(11,))]),
        _step(2, chunks=[PrefillInput(1, _ids(14, 6), None, False, cache_block_ids=(12,))]
              + [PrefillInput(2, np.array([vocab]), GREEDY, True)]),
        _step(3, chunks=[PrefillInput(1, _ids(20, 6), None, True, cache_block_ids=(13, 14))]
              + [PrefillInput(3, _ids(30, 5), GREEDY, True)]),
    ]  # fmt: skip
    answers, _ = _one_at_a_time(engine, steps)
    assert answers[1][0] == "refused"
    assert answers[2][0] != "refused", answers[2]
    assert {rid: error for rid, _, error, *_ in answers[2]}[3] == ""
