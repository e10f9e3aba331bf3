"""The worker caching the blocks a running sequence's decodes filled (StepStreamRequest.cache_sequence_blocks):
a later sequence started on them computes the logits a full prefill computes, also when the decode writing a
block's last position was still in flight (pipelined); ids of a sequence the stream no longer holds are skipped,
and malformed registrations refuse the step, naming the field."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from common.errors import InvalidRequestError
from common.model_format import ModelDir
from common.pb import worker_pb2 as pb
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.serving.step_stream import MAX_FREE_IDS, StepLimits, StreamSession
from expert_service.serving.wire import step_request
from tests.expert_service.serving.test_step_pump_differential import GREEDY, _engine, _pumped, _step
from tests.helpers import cpu_engine

BLOCK = 4  # _engine's kv_block_size
PROMPT = np.array([17, 40, 9, 88, 23, 61])  # one full block, then two tokens of the next


def _with_blocks(step, rows):
    return replace(step, sequence_blocks=np.asarray(rows, "<u8").reshape(-1, 3))


def _tokens(answer, rid):
    return [o.token_id for o in answer.result.outputs if o.request_id == rid]


def _reused_equals_full(engine, session, generated):
    """Sequence 2 starts on blocks 20 (prompt) and 21 (prompt tail + two generated tokens); its logits equal
    those of sequence 3 prefilling the same tokens whole."""
    tail = np.array([5, 99, 31])
    known = np.concatenate([PROMPT, generated[:2]])
    on_blocks = PrefillInput(2, tail, GREEDY, True, prefix_block_ids=(20, 21))
    reused = session.run(_step(10, chunks=[on_blocks]))
    assert not reused.result.outputs[0].error, reused.result.outputs
    full = session.run(_step(11, chunks=[PrefillInput(3, np.concatenate([known, tail]), GREEDY, True)]))
    np.testing.assert_allclose(reused.result.logits[0], full.result.logits[0], rtol=1e-5, atol=1e-5)


def test_a_sequence_on_generated_blocks_equals_a_full_prefill(tiny_model):
    engine = _engine(tiny_model, False, 256)
    session = StreamSession(engine, {})
    first = session.run(_step(1, chunks=[PrefillInput(1, PROMPT, GREEDY, True, cache_block_ids=(20,))]))
    generated = _tokens(first, 1)
    generated += _tokens(session.run(_step(2, decodes=[1])), 1)  # feeds position 6
    # feeds position 7, which fills block 1: the same step registers it, once launched
    answer = session.run(_with_blocks(_step(3, decodes=[1]), [(1, 1, 21)]))
    generated += _tokens(answer, 1)
    assert not answer.refused and engine.allocator.cached[(session.id, 21)] == engine.allocator.tables[1][1]
    _reused_equals_full(engine, session, np.array(generated))
    session.run(_step(12, frees=[1, 2, 3]))
    assert engine.allocator.num_used_blocks == 0 and engine.allocator.num_cached_blocks == 2


def test_a_block_whose_last_position_is_still_in_flight_is_registered_behind_it(tiny_model):
    """Pumped: the step feeding position 7 (from its predecessor's argmax, on the worker) registers block 1; it
    launches behind the step before it, and the KV is written by the time a later step reads it."""
    steps = [_step(1, chunks=[PrefillInput(1, PROMPT, GREEDY, True, cache_block_ids=(20,))])]
    steps += [_step(2, decodes=[1]), _with_blocks(_step(3, decodes=[1]), [(1, 1, 21)]), _step(4, decodes=[1])]
    engine = _engine(tiny_model, True, 256)
    answers, depths = _pumped(engine, steps)
    assert all(a[0] != "refused" for a in answers) and max(depths) >= 1, (answers, depths)
    generated = np.array([a[0][1] for a in answers])
    # the pumped stream ended: its blocks are gone; a fresh session redoes the steps one at a time for the check
    engine = _engine(tiny_model, False, 256)
    session = StreamSession(engine, {})
    for step in steps:
        session.run(step)
    _reused_equals_full(engine, session, generated)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([(1, 1, 0)], "has id 0"),
        ([(1, 1, 20)], "taken"),  # the prompt block's id
        ([(1, 0, 22)], "taken"),  # block 0 is cached under another id
        ([(1, 1, 21), (1, 1, 21)], "taken"),
    ],
)
def test_malformed_registrations_refuse_the_step(tiny_model, rows, message):
    engine = _engine(tiny_model, False, 256)
    session = StreamSession(engine, {})
    session.run(_step(1, chunks=[PrefillInput(1, PROMPT, GREEDY, True, cache_block_ids=(20,))]))
    session.run(_step(2, decodes=[1]))
    answer = session.run(_with_blocks(_step(3, decodes=[1]), rows))
    assert answer.result is None and "cache_sequence_blocks" in answer.refused and message in answer.refused
    assert (session.id, 21) not in engine.allocator.cached or rows == [(1, 1, 20)]


def test_a_sequence_no_longer_held_and_a_block_not_full_are_skipped(tiny_model):
    """A block not full: a step refused as a whole before this one left it short (the router, which sent this
    step before it knew, fails the sequence and drops the id when that refusal comes back)."""
    engine = _engine(tiny_model, False, 256)
    session = StreamSession(engine, {})
    session.run(_step(1, chunks=[PrefillInput(1, PROMPT, GREEDY, True)]))
    session.run(_step(2, chunks=[PrefillInput(4, PROMPT, GREEDY, True)]))
    answer = session.run(_with_blocks(_step(3, frees=[1], decodes=[4]), [(1, 0, 21), (7, 0, 22), (4, 2, 23)]))
    assert answer.refused == "" and not engine.allocator.cached  # 4 holds 7 tokens after this step's decode


def test_a_block_the_step_allocates_is_registered_after_its_launch(tiny_model):
    """One-token blocks: the decode filling block 6 also allocates it, at launch; checked before, it is not there."""
    config = EngineConfig(backend="cpu", kv_block_size=1, kv_cache_tokens=64, max_batch_tokens=48, max_batch_size=6)
    engine = cpu_engine(ModelDir.open(tiny_model), config, False)
    session = StreamSession(engine, {})
    session.run(_step(1, chunks=[PrefillInput(1, PROMPT, GREEDY, True)]))
    answer = session.run(_with_blocks(_step(2, decodes=[1]), [(1, 6, 21)]))
    assert answer.refused == "" and engine.allocator.cached == {(session.id, 21): engine.allocator.tables[1][6]}


@pytest.mark.parametrize(
    "chunks, rows, message",
    [
        ([PrefillInput(6, np.arange(3, 13), GREEDY, True, start_position=2)], [(6, 2, 21)], "prefills"),
        ([], [(1, 1, 21), (1, 1, 22)], "named twice"),
        ([PrefillInput(5, PROMPT, GREEDY, True, cache_block_ids=(21,))], [(1, 1, 21)], "taken"),
    ],
)
def test_registrations_a_chunk_of_the_step_contradicts_refuse_it(tiny_model, chunks, rows, message):
    """A prefilling sequence's blocks are named by its chunks; a block gets one id; a chunk's id is taken."""
    engine = _engine(tiny_model, False, 256)
    session = StreamSession(engine, {})
    session.run(_step(1, chunks=[PrefillInput(1, PROMPT, GREEDY, True), PrefillInput(6, PROMPT[:2], GREEDY, False)]))
    session.run(_step(2, decodes=[1]))
    answer = session.run(_with_blocks(_step(3, chunks=chunks, decodes=[1]), rows))
    assert answer.result is None and "cache_sequence_blocks" in answer.refused and message in answer.refused
    assert not engine.allocator.cached


@pytest.mark.parametrize("num_bytes", [8, 16, 28, 24 * (MAX_FREE_IDS + 1)])
def test_packed_rows_not_whole_triples_or_too_many_are_refused(num_bytes):
    request = pb.StepStreamRequest(step_id=1, cache_sequence_blocks=bytes(num_bytes))
    with pytest.raises(InvalidRequestError):
        step_request(request, StepLimits((0,), 16, 8))


def test_too_many_rows_are_named_in_the_refusal():
    request = pb.StepStreamRequest(step_id=1, cache_sequence_blocks=bytes(24 * (MAX_FREE_IDS + 1)))
    with pytest.raises(InvalidRequestError, match="cache_sequence_blocks rows"):
        step_request(request, StepLimits((0,), 16, 8))


def test_a_decode_of_a_sequence_still_prefilling_fills_no_block(tiny_model):
    """The decode fails alone (no sampled token to feed) and writes nothing: block 0 keeps 3 of its 4 positions, so
    it is not full and is skipped; registered, a later sequence would start on a stale fourth row, and the next
    chunk would write into a cached block."""
    engine = _engine(tiny_model, False, 256)
    session = StreamSession(engine, {})
    session.run(_step(1, chunks=[PrefillInput(1, PROMPT[:3], GREEDY, False)]))
    answer = session.run(_with_blocks(_step(2, decodes=[1]), [(1, 0, 21)]))
    assert answer.refused == "" and [o.error for o in answer.result.outputs] == ["UNKNOWN_SEQUENCE"]
    assert not engine.allocator.cached and engine.sequences[1].num_cached == 3
    on_block = session.run(_step(3, chunks=[PrefillInput(2, PROMPT[3:], GREEDY, True, prefix_block_ids=(21,))]))
    assert [o.error for o in on_block.result.outputs] == ["UNKNOWN_PREFIX_BLOCK"]
