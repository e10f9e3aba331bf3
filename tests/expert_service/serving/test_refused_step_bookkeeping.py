"""A step stream message the worker refuses as a whole still runs its frees and evictions. The router takes them
as done when it builds the step, whatever the answer (it fails the step's requests and never sends them again),
so a worker that dropped them would hold blocks the router counts as free: leaked sequences, cached blocks no one
evicts, and the router's later admissions refused for want of room. Each of the two lists is dropped only when it
is itself malformed (then there is nothing to read it as)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from expert_service.engine.token_masks import mask_words
from tests.expert_service.serving.test_worker_lifecycle import Stream

BLOCK = 4  # the test worker's kv_block_size
GREEDY = pb.SamplingParams(temperature=0, top_p=1.0)


def _ids(values) -> bytes:
    return np.asarray(values, "<u8").tobytes()


@pytest.fixture
def stream(worker):
    channel = grpc.insecure_channel(worker.address)
    s = Stream(worker_pb2_grpc.WorkerServiceStub(channel))
    yield s
    s.close()
    channel.close()


def _cached_prompt(stream) -> None:
    """Sequence 1: a prompt of two full blocks and one token, its full blocks cached under ids 20 and 21."""
    chunk = pb.PrefillChunk(
        request_id=1, token_ids=list(range(5, 5 + 2 * BLOCK + 1)), sampling=GREEDY, is_last=True,
        cache_block_ids=[20, 21],
    )  # fmt: skip
    answer = stream.step(pb.StepStreamRequest(step_id=1, chunks=[chunk]))
    assert not answer.step_error and not answer.errors and answer.kv_blocks_used == 3


def _malformed(kind: str, vocab: int) -> dict:
    if kind == "late_masks":  # well formed, but no step waits for them: refused by the pump, not the wire
        return {"late_mask_request_ids": _ids([1]), "late_token_masks": bytes(mask_words(vocab) * 4)}
    return {
        "decode_ids": {"decode_request_ids": b"\x01\x02\x03"},  # not whole uint64s
        "sequence_blocks": {"cache_sequence_blocks": _ids([1, 0])},  # not whole triples
    }[kind]


@pytest.mark.parametrize("kind", ["decode_ids", "sequence_blocks", "late_masks"])
def test_a_refused_message_still_frees_and_evicts(worker, stream, kind):
    engine = worker.servicer.engine
    _cached_prompt(stream)
    assert engine.allocator.num_cached_blocks == 2
    bookkeeping = {"free_request_ids": _ids([1]), "evict_block_ids": _ids([20])}
    refused = stream.step(
        pb.StepStreamRequest(step_id=2, **bookkeeping, **_malformed(kind, engine.model_config.vocab_size))
    )
    assert refused.step_error and refused.kv_blocks_used == 0
    assert 1 not in engine.sequences
    assert [block_id for _, block_id in engine.allocator.cached] == [21]  # 20 evicted, 21 still cached
    # a later step starts a sequence on the block still cached
    on_21 = pb.PrefillChunk(
        request_id=2, token_ids=[7, 8], sampling=GREEDY, is_last=True, prefix_block_ids=[21], start_position=BLOCK
    )
    answer = stream.step(pb.StepStreamRequest(step_id=3, chunks=[on_21]))
    assert not answer.step_error and not answer.errors, answer


def test_a_malformed_list_of_frees_or_evictions_is_dropped_alone(worker, stream):
    allocator = worker.servicer.engine.allocator
    _cached_prompt(stream)
    refused = stream.step(pb.StepStreamRequest(step_id=2, free_request_ids=b"\x01", evict_block_ids=_ids([20, 21])))
    assert "free_request_ids" in refused.step_error
    assert 1 in worker.servicer.engine.sequences and not allocator.cached  # nothing freed, both evicted
    refused = stream.step(pb.StepStreamRequest(step_id=3, free_request_ids=_ids([1]), evict_block_ids=b"\x01"))
    assert "evict_block_ids" in refused.step_error
    assert not worker.servicer.engine.sequences and refused.kv_blocks_used == 0
    assert allocator.num_free_blocks == allocator.num_blocks
